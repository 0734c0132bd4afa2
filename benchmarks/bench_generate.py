"""End-to-end generation speed: ``specdec.generate`` against Hugging Face's generate paths, in one process on one GPU.

Every provider does identical work: the same prompts, greedy decoding (or sampling at ``--temperature``), a fixed
number of new tokens (no eos). ``--verification token,block`` runs the specdec_static and specdec_eager rows under
each scheme (``verification`` column; block verification changes sampled rounds only, greedy ones are the arg-max
rule under both).

Providers
    hf_eager        ``verifier.generate()`` (dynamic cache, eager forward calls)
    hf_static       ``verifier.generate(cache_implementation="static")`` (transformers compiles the decoding forward)
    hf_assisted     ``verifier.generate(assistant_model=drafter)`` with ``num_assistant_tokens = K``, a constant
                    schedule and no confidence cut-off (batch 1: transformers supports no other)
    specdec_eager   ``specdec.generate(static=False)`` (dynamic caches, eager forward calls)
    specdec_plain   ``specdec.generate(num_draft_tokens=0)``: the static path without speculation
    specdec_static  ``specdec.generate()`` (the static path: slot caches, rounds replayed from CUDA graphs; the models
                    on ``--runner``, default "auto": the native decode runner where it applies)
    specdec_auto    ``specdec.generate(num_draft_tokens="auto")``
    *_compiled      the same with ``compile=True`` on the HF forward (``runner="hf"``: each model's forward fused by
                    torch.compile, then captured)

Models (random bf16 weights; nothing is downloaded)
    llama-1b  Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocab 128256, tied head
    llama-3b  Llama-3.2-3B's shape: hidden 3072, 28 layers, 24 query / 8 KV heads, MLP 8192, vocab 128256, tied head
    demo      the demo's trained pair (``specdec demo`` caches it) on its synthetic task prompts: ``--demo-pair DIR``

Drafters with a chosen acceptance. The drafter is the verifier's first ``--draft-layers`` layers with the verifier's
final norm and head (a layer-skip self-drafter: shared weights, no extra memory). In the verifier, the layers after
those have their output projections (attention ``o_proj``, MLP ``down_proj``) scaled by a factor eps: at eps = 0 the
verifier computes what the drafter computes (alpha = 1), and a larger eps moves its next-token choice away. For each
target alpha, eps is found by bisection on greedy generation of the benchmark's prompts (alpha read from specdec's
own counters); every provider then runs on that verifier. Scaling weights changes no cost.

Columns: ``alpha`` is the per-position acceptance measured on the row's own run (accepted over tested draft
positions, the alpha of the speed-up formula); ``acceptance_rate`` is accepted over proposed drafts; ``c`` is the
time of one drafter decoding step over one verifier decoding step on the row's path (static: CUDA-graph replays of
single-token steps; eager: synchronised eager calls); ``predicted_speedup`` = S(alpha, K, c) =
(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)); ``achieved_speedup`` = the path's tokens/s over the same path without
speculation (specdec_plain for the static path, specdec at K = 0 with ``static=False`` for the eager path,
specdec_plain_compiled for the compiled path); ``first_call_s`` is the first call's wall time (graph capture,
compilation); ``rows_identical`` is the fraction of batch rows whose tokens equal hf_eager's greedy tokens (bf16
changes of batch shape can flip near-ties), ``first_mismatch`` the mean index of the first differing token (both blank
when sampling). Under block verification ``alpha`` is the block run's accepted over tested draft positions and no
``predicted_speedup`` is given (S assumes token-wise verification).

    python benchmarks/bench_generate.py --model llama-1b            # rows into benchmarks/results/generate.csv
    python benchmarks/bench_generate.py --model llama-3b --batches 1,8 --ks 4

Step benchmark (``--step``): one decoding step of the verifier, each captured in a CUDA graph, on the HF forward
(``hf``: the static path's ``_ModelSlot``) and on the native runner (``native``), in one process, at the shapes of
``--step-models`` (llama-1b, llama-3b, 12x768 and 24x1024 with a 12k vocabulary) and ``--batches``. Rows go to
``results/generate_step.csv``. Columns: ``plain_step_ms`` (one token a row), ``verify_step_ms`` (K + 1 = 5 tokens a
row, the logits of all five), ``drafter_step_ms`` (the verifier's first ``--step-draft-layers`` layers as a
layer-skip drafter, one token), ``cost_ratio`` = drafter over plain step, ``weight_bytes`` (every parameter a step
reads: the head and all layers; an untied embedding is gathered, not read), ``floor_ms`` (the GEMV-chain floor: every
``nn.Linear`` of the model as one cuBLAS call on the batch's rows, all in one CUDA graph), ``hbm_fraction`` =
weight_bytes / plain step / copy bandwidth (``copy_gbps``, measured in the same run), ``layer_overhead_us`` = (plain
step - drafter step) / (L - L_drafter) - one layer's bytes / copy bandwidth: the fixed cost a decoder layer adds
beyond reading its weights.

    python benchmarks/bench_generate.py --step --batches 1,8,32     # rows into benchmarks/results/generate_step.csv

    python benchmarks/bench_generate.py --batches 1,8 --alphas 0.5,0.75 --ks 4,8 --temperature 1 \
        --verification token,block --providers specdec_static --no-compiled      # block vs token-wise
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import time

import torch

import specdec
from specdec.decoding.static import clear_engines, get_engine

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generate.csv")
STEP_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generate_step.csv")
SHAPES = {
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192),
    "llama-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                     intermediate_size=8192),
    "12x768": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=3072, vocab_size=12288, tie_word_embeddings=False),
    "24x1024": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=4096, vocab_size=12288, tie_word_embeddings=False),
}
STEP_KEY = ("gpu", "model", "batch", "provider")
KEY = ("gpu", "model", "alpha_target", "batch", "num_draft_tokens", "provider", "temperature", "verification")
KEY_DEFAULTS = {"temperature": "0.0", "verification": "token"}  # rows written before these columns existed


def build_pair(name: str, draft_layers: int, seed: int = 0):
    """A random bf16 verifier of the named shape and its layer-skip drafter (shared modules)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = {"vocab_size": 128256, "tie_word_embeddings": True, **SHAPES[name]}
    config = LlamaConfig(max_position_embeddings=4096, rope_theta=500000.0, attn_implementation="sdpa", **shape)
    with torch.device("cuda"):
        verifier = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    drafter_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": draft_layers})
    drafter_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        drafter = LlamaForCausalLM(drafter_config)
    drafter.model.embed_tokens = verifier.model.embed_tokens
    drafter.model.layers = torch.nn.ModuleList(verifier.model.layers[:draft_layers])
    drafter.model.norm = verifier.model.norm
    drafter.model.rotary_emb = verifier.model.rotary_emb
    drafter.lm_head = verifier.lm_head
    return verifier, drafter.eval()


class DeepScale:
    """Scales the output projections of the verifier's layers after the drafter's by eps (in place)."""

    def __init__(self, verifier, draft_layers: int):
        self.weights = [w for layer in verifier.model.layers[draft_layers:]
                        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
        self.originals = [w.detach().clone() for w in self.weights]
        self.eps = 1.0

    def set(self, eps: float) -> None:
        with torch.no_grad():
            for weight, original in zip(self.weights, self.originals, strict=True):
                weight.copy_(original * eps)
        self.eps = eps


def calibrate(scale: DeepScale, verifier, drafter, prompts, target: float, new_tokens: int, steps: int = 9,
              temperature: float = 0.0) -> float:
    """Bisection on eps in [0, 1] for token-wise acceptance ``target`` at K = 4 (greedy, or sampled at
    ``temperature``; alpha falls as eps grows)."""
    low, high = 0.0, 1.0
    for _ in range(steps):
        mid = (low + high) / 2
        scale.set(mid)
        stats = specdec.generate(verifier, drafter, prompts, max_new_tokens=new_tokens, num_draft_tokens=4,
                                 pad_token_id=0, temperature=temperature, seed=0).stats
        alpha = float(stats.accepted_per_position.sum()) / max(int(stats.attempted_per_position.sum()), 1)
        low, high = (mid, high) if alpha > target else (low, mid)
    scale.set((low + high) / 2)
    return scale.eps


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(first call seconds, median of ``repeats`` later calls, last output)."""
    def once():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    first, out = once()
    times = []
    for _ in range(repeats):
        seconds, out = once()
        times.append(seconds)
    return first, statistics.median(times), out


def step_cost_ratio(verifier, drafter, batch: int, vocab: int, static: bool, compiled: bool = False,
                    runner: str = "auto") -> float:
    """c = one drafter decoding step / one verifier decoding step, on the static path (graph replays, on ``runner``)
    or eager."""
    from specdec.decoding.timing import median_seconds

    engine = get_engine(verifier, drafter, batch, 256, vocab, 1, 1, torch.device("cuda"), "auto", True, compiled,
                        runner=runner if static and not compiled else "hf")
    ids = torch.zeros((batch, 1), dtype=torch.int64, device="cuda")
    slots = torch.full((batch, 1), 100, dtype=torch.int64, device="cuda")
    seconds = {}
    for name, model in (("verifier", engine.verifier), ("drafter", engine.drafter)):
        def step(model=model):
            return model.forward(ids, slots, 1)

        if static:
            step = engine._capture(step)
        seconds[name] = median_seconds(step, torch.device("cuda"), 20)
    return seconds["drafter"] / seconds["verifier"]


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows equal to the reference, mean index of the first differing token; the length if none)."""
    differ = tokens.cpu() != reference.cpu()
    first = torch.where(differ.any(1), differ.int().argmax(1), torch.tensor(differ.shape[1]))
    return float((~differ.any(1)).float().mean()), float(first.float().mean())


def run_case(args, env: dict, verifier, drafter, scale: DeepScale | None, prompts: torch.Tensor, mask: torch.Tensor,
             target: float | None, vocab: int) -> list[dict]:
    """Every provider at one (batch, target alpha): rows for K = 0, every K of ``args.ks`` and "auto"."""
    rows = []
    batch, new_tokens, temperature = prompts.shape[0], args.new_tokens, args.temperature
    sampling = temperature > 0
    hf_kwargs = dict(attention_mask=mask, do_sample=sampling, max_new_tokens=new_tokens, pad_token_id=0)
    if sampling:
        hf_kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    sd_kwargs = dict(temperature=temperature, seed=0) if sampling else {}
    sd_kwargs["runner"] = args.runner

    def hf(**extra):
        return lambda: verifier.generate(prompts, **hf_kwargs, **extra)[:, prompts.shape[1]:]

    def sd(**extra):
        return lambda: specdec.generate(verifier, drafter, prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                        pad_token_id=0, **{**sd_kwargs, **extra})

    eps = (calibrate(scale, verifier, drafter, prompts, target, new_tokens, temperature=temperature)
           if scale is not None else float("nan"))
    base = dict(env, model=args.model, alpha_target=target, eps=round(eps, 5), batch=batch,
                prompt_len=prompts.shape[1], new_tokens=new_tokens, draft_layers=args.draft_layers,
                temperature=temperature)
    first, seconds, reference = timed(hf(), 1)

    def row(provider, k, first_s, seconds, tokens, alpha=float("nan"), c=float("nan"), achieved=None,
            verification="token"):
        identical, first_mismatch = ("", "") if sampling else agreement(tokens, reference)
        predicted = (float(specdec.speedup(alpha, k, c)) if k not in (0, "auto") and alpha == alpha
                     and verification == "token" else None)
        rows.append(dict(base, num_draft_tokens=k, provider=provider, verification=verification,
                         alpha=round(alpha, 4), c=round(c, 4),
                         tokens_per_s=round(batch * new_tokens / seconds, 1), seconds=round(seconds, 4),
                         first_call_s=round(first_s, 3), predicted_speedup=predicted and round(predicted, 3),
                         achieved_speedup=achieved and round(achieved, 3),
                         achieved_over_predicted=achieved and predicted and round(achieved / predicted, 3),
                         rows_identical=identical if sampling else round(identical, 3),
                         first_mismatch=first_mismatch if sampling else round(first_mismatch, 1),
                         acceptance_rate=round(last_stats[0].total_acceptance_rate, 4)
                         if provider.startswith("specdec") and k else "",
                         path=last_stats[0].path if provider.startswith("specdec") else "",
                         runner=last_stats[0].runner if provider.startswith("specdec") else "",
                         setup_s=round(last_stats[0].setup_time_s, 3) if provider.startswith("specdec") else ""))
        print({key: rows[-1][key] for key in ("model", "alpha_target", "batch", "num_draft_tokens", "provider",
                                              "verification", "alpha", "c", "tokens_per_s", "achieved_over_predicted",
                                              "first_call_s", "rows_identical")}, flush=True)

    def tokens_of(out):
        last_stats[0] = out.stats
        return out.sequences[:, prompts.shape[1]:]

    def alpha_of(out):
        stats = out.stats
        return float(stats.accepted_per_position.sum()) / max(int(stats.attempted_per_position.sum()), 1)

    last_stats = [None]

    def wanted(provider):
        return args.providers is None or provider in args.providers

    row("hf_eager", 0, first, seconds, reference)
    if wanted("hf_static"):
        first, seconds, out = timed(hf(cache_implementation="static"), args.repeats)
        row("hf_static", 0, first, seconds, out)
    first, plain_s, out = timed(sd(num_draft_tokens=0), args.repeats)
    row("specdec_plain", 0, first, plain_s, tokens_of(out))
    if wanted("specdec_eager"):
        first, eager_plain_s, out = timed(sd(num_draft_tokens=0, static=False), 1)
        row("specdec_eager", 0, first, eager_plain_s, tokens_of(out))
        c_eager = step_cost_ratio(verifier, drafter, batch, vocab, False)
    c_static = step_cost_ratio(verifier, drafter, batch, vocab, True, runner=args.runner)
    for k in args.ks if wanted("specdec_static") else []:
        for verification in args.verifications:
            first, seconds, out = timed(sd(num_draft_tokens=k, verification=verification), args.repeats)
            row("specdec_static", k, first, seconds, tokens_of(out), alpha_of(out), c_static,
                plain_s / seconds, verification)
            if k == args.eager_k and wanted("specdec_eager"):
                first, seconds, out = timed(sd(num_draft_tokens=k, static=False, verification=verification), 1)
                row("specdec_eager", k, first, seconds, tokens_of(out), alpha_of(out), c_eager,
                    eager_plain_s / seconds, verification)
        if batch == 1 and wanted("hf_assisted"):
            schedule = dict(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                            assistant_confidence_threshold=0.0)
            for key, value in schedule.items():
                setattr(drafter.generation_config, key, value)
            first, seconds, out = timed(hf(assistant_model=drafter, **schedule), 1)
            row("hf_assisted", k, first, seconds, out)
    first, seconds, out = timed(sd(num_draft_tokens="auto"), args.repeats)
    row("specdec_auto", "auto", first, seconds, tokens_of(out), alpha_of(out), c_static,
        plain_s / seconds)
    rows[-1]["mean_draft_tokens"] = round(out.stats.summary()["mean_draft_length"], 2)
    if args.compiled:
        first, plain_s, out = timed(sd(num_draft_tokens=0, compile=True, runner="hf"), args.repeats)
        row("specdec_plain_compiled", 0, first, plain_s, tokens_of(out))
        c_compiled = step_cost_ratio(verifier, drafter, batch, vocab, True, compiled=True)
        for k in args.compiled_ks if wanted("specdec_compiled") else []:
            first, seconds, out = timed(sd(num_draft_tokens=k, compile=True, runner="hf"), args.repeats)
            row("specdec_compiled", k, first, seconds, tokens_of(out), alpha_of(out), c_compiled,
                plain_s / seconds)
        first, seconds, out = timed(sd(num_draft_tokens="auto", compile=True, runner="hf"), args.repeats)
        row("specdec_auto_compiled", "auto", first, seconds, tokens_of(out), alpha_of(out),
            c_compiled, plain_s / seconds)
        rows[-1]["mean_draft_tokens"] = round(out.stats.summary()["mean_draft_length"], 2)
    return rows


def run_model(args, env: dict) -> list[dict]:
    """Every provider on every (batch, target alpha, K) of ``args``; rows are merged into ``args.out`` per batch."""
    rows = []
    if args.model == "demo":
        from specdec.cli.demo_pair import load_pair

        pair = load_pair(args.demo_pair)
        verifier, drafter = pair.verifier.cuda(), pair.drafter.cuda()
        scale, targets = None, [None]
        vocab = len(pair.tokenizer)
    else:
        verifier, drafter = build_pair(args.model, args.draft_layers)
        scale, targets = DeepScale(verifier, args.draft_layers), args.alphas
        vocab = verifier.config.vocab_size
    for model in (verifier, drafter):  # fixed-length generation: no eos
        model.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        if args.model == "demo":
            from specdec.data import synthetic_task_suite

            texts = [ex.prompt for exs in synthetic_task_suite(batch, seed=1).values() for ex in exs]
            encoded = pair.tokenizer(texts[:batch], return_tensors="pt", padding=True, padding_side="left")
            prompts, mask = encoded["input_ids"].cuda(), encoded["attention_mask"].cuda()
        else:
            prompts = torch.randint(100, vocab, (batch, args.prompt_len), generator=generator).cuda()
            mask = torch.ones_like(prompts)
        for target in targets:
            rows += run_case(args, env, verifier, drafter, scale, prompts, mask, target, vocab)
        clear_engines()
        merge_rows(args.out, rows)  # after every batch size, so a run cut short keeps what it measured
    return rows


def graph_ms(step, replays: int = 20, samples: int = 7) -> float:
    """Median milliseconds of one replay of a captured step (``samples`` timings of ``replays`` back-to-back)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def gemv_floor_ms(verifier, batch: int) -> float:
    """Every ``nn.Linear`` of ``verifier`` as one cuBLAS call on ``batch`` rows, all in one CUDA graph: the time a
    step needs to read its projection weights with one kernel each."""
    linears = [m for m in verifier.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, device="cuda", dtype=m.weight.dtype) for m in linears}

    def chain():
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return graph_ms(graph.replay)


def step_rows(args, env: dict, name: str, copy_gbps: float) -> list[dict]:
    """hf and native step times of one model shape at every batch size of ``args``."""
    verifier, drafter = build_pair(name, args.step_draft_layers)
    layers = verifier.config.num_hidden_layers
    vocab = verifier.config.vocab_size
    embedding = verifier.get_input_embeddings().weight
    tied = embedding is verifier.get_output_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in verifier.parameters() if tied or p is not embedding)
    layer_bytes = sum(p.numel() * p.element_size() for p in verifier.model.layers[0].parameters())
    rows = []
    for batch in args.batches:
        floor = gemv_floor_ms(verifier, batch)
        context, num_drafts = 192, 4
        ids = torch.randint(0, vocab, (batch, num_drafts + 1), device="cuda")
        slots = context + torch.arange(num_drafts + 1, device="cuda").expand(batch, -1)
        for provider in args.step_providers:
            engine = get_engine(verifier, drafter, batch, 256, vocab, num_drafts, 1, torch.device("cuda"), "auto",
                                True, False, "native" if provider == "native" else "hf")
            kind = type(engine.verifier).__name__
            times = {}
            for step, model, width in (("plain", engine.verifier, 1), ("verify", engine.verifier, num_drafts + 1),
                                       ("drafter", engine.drafter, 1)):
                step_ids, step_slots = ids[:, :width].contiguous(), slots[:, :width].contiguous()

                def call(model=model, width=width, step_ids=step_ids, step_slots=step_slots):
                    return model.forward(step_ids, step_slots, width)

                times[step] = graph_ms(engine._capture(call))
            overhead = (times["plain"] - times["drafter"]) / (layers - args.step_draft_layers) * 1e3 \
                - layer_bytes / copy_gbps / 1e3
            rows.append(dict(env, model=name, batch=batch, provider=provider, runner_class=kind,
                             plain_step_ms=round(times["plain"], 4), verify_step_ms=round(times["verify"], 4),
                             verify_over_plain=round(times["verify"] / times["plain"], 3),
                             drafter_step_ms=round(times["drafter"], 4), draft_layers=args.step_draft_layers,
                             cost_ratio=round(times["drafter"] / times["plain"], 4), weight_bytes=weight_bytes,
                             floor_ms=round(floor, 4),
                             hbm_fraction=round(weight_bytes / (times["plain"] * 1e-3) / (copy_gbps * 1e9), 3),
                             layer_overhead_us=round(overhead, 2), copy_gbps=round(copy_gbps, 1)))
            print({k: rows[-1][k] for k in ("model", "batch", "provider", "plain_step_ms", "verify_step_ms",
                                             "cost_ratio", "floor_ms", "hbm_fraction", "layer_overhead_us")},
                  flush=True)
            clear_engines()
    del verifier, drafter
    torch.cuda.empty_cache()
    return rows


def run_steps(args, env: dict) -> list[dict]:
    """The step benchmark over ``args.step_models``; rows merged into ``args.step_out`` after every model."""
    from common import measure_copy_bandwidth

    copy_gbps = measure_copy_bandwidth()
    rows = []
    for name in args.step_models:
        rows += step_rows(args, env, name, copy_gbps)
        merge_rows(args.step_out, rows, STEP_KEY)
    return rows


def merge_rows(path: str, rows: list[dict], key: tuple[str, ...] = KEY) -> None:
    """Writes ``rows`` into the CSV at ``path``, replacing rows with the same key (GPU, model, alpha, batch, K,
    provider)."""
    old = []
    if os.path.exists(path):
        with open(path, newline="") as handle:
            old = list(csv.DictReader(handle))
    defaults = KEY_DEFAULTS if key == KEY else {}
    new_keys = {tuple(str(r.get(k, defaults.get(k, ""))) for k in key) for r in rows}
    kept = [r for r in old if tuple(r.get(k) or defaults.get(k, "") for k in key) not in new_keys]
    fields = list(dict.fromkeys([*rows[0], *(k for r in rows for k in r), *(k for r in kept for k in r)]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(kept + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*SHAPES, "demo"], default="llama-1b")
    parser.add_argument("--demo-pair", help="folder of the demo pair (verifier/, drafter/), for --model demo")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default: 1,8,32)")
    parser.add_argument("--ks", default="2,4,8", help="comma-separated draft lengths K (default: 2,4,8)")
    parser.add_argument("--alphas", default="0.2,0.5,0.75", help="target acceptances (default: 0.2,0.5,0.75)")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the self-drafter (default: 1)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: 32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (default: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per fast provider (default: 3)")
    parser.add_argument("--eager-k", type=int, default=4, help="K of the specdec_eager rows (default: 4)")
    parser.add_argument("--providers", default=None,
                        help="comma-separated providers to run among hf_static, hf_assisted, specdec_eager, "
                             "specdec_static, specdec_compiled (default: all; hf_eager, specdec_plain and the "
                             "auto rows always run)")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false",
                        help="leave out the specdec *_compiled providers (their compilation)")
    parser.add_argument("--compiled-ks", default="4", help="K values of the specdec_compiled rows (default: 4)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); > 0: every provider samples at this temperature (seeded)")
    parser.add_argument("--verification", default="token",
                        help="comma-separated schemes of the specdec_static / specdec_eager rows among token, block "
                             "(default: token)")
    parser.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                        help="specdec.generate's runner for the static rows (default: auto)")
    parser.add_argument("--out", default=RESULTS, help=f"CSV to merge rows into (default: {RESULTS})")
    parser.add_argument("--step", action="store_true", help="run the step benchmark instead (module docstring)")
    parser.add_argument("--step-models", default="llama-1b,12x768,24x1024,llama-3b",
                        help="comma-separated shapes of the step benchmark")
    parser.add_argument("--step-providers", default="hf,native", help="comma-separated: hf, native")
    parser.add_argument("--step-draft-layers", type=int, default=2, help="layers of the step benchmark's drafter")
    parser.add_argument("--step-out", default=STEP_RESULTS, help=f"CSV of the step rows (default: {STEP_RESULTS})")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.compiled_ks = [int(k) for k in args.compiled_ks.split(",")]
    args.verifications = args.verification.split(",")
    if not set(args.verifications) <= {"token", "block"}:
        parser.error(f"--verification takes token and/or block, got {args.verification!r}")
    args.providers = None if args.providers is None else set(args.providers.split(","))
    if args.model == "demo" and not args.demo_pair:
        parser.error("--model demo needs --demo-pair DIR")
    import transformers
    import triton

    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, transformers=transformers.__version__)
    args.step_models = args.step_models.split(",")
    args.step_providers = args.step_providers.split(",")
    with torch.no_grad():
        rows = run_steps(args, env) if args.step else run_model(args, env)
    print(f"{len(rows)} rows -> {args.step_out if args.step else args.out}")


if __name__ == "__main__":
    main()
