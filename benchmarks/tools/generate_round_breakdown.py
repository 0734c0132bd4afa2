"""Where a round of the static ``generate`` path goes, against the cost model S(alpha, K, c) assumes.

S assumes a round of K drafts costs ``K c + 1`` single-token verifier steps. This times, from CUDA-graph replays on
the static path, the single-token verifier and drafter steps, the verifier's (K + 1)-token step, the drafter's
two-token first step and whole rounds (K = 0 and K), so the difference splits into: the wider verifier step, the
wider first drafter step, and the rest of the round (sampling, acceptance, bookkeeping). It also runs one ``generate``
call per batch and reports the rounds it took against the rounds its average row needed (a batch runs until its
slowest row is done), and that call's wall time per round after its prompt pass (``wall_round_ms``: the captured
round plus the host's work between rounds; ``prefill_ms``, a call with one new token, is taken off first), so
``wall_round_ms - round_K_ms`` is the host's share. ``--profile`` also prints the torch profiler's table of one
replayed round's kernels and of one whole call (host and device), and ``--trace DIR`` writes that call's Chrome trace
(the gaps between rounds are visible there).

    python benchmarks/tools/generate_round_breakdown.py --model llama-1b --batches 1,8,32 --k 4
    python benchmarks/tools/generate_round_breakdown.py --batches 1 --runner native --profile --trace /tmp/trace
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_generate import SHAPES, DeepScale, build_pair, calibrate  # noqa: E402

import specdec  # noqa: E402
from specdec.decoding.static import Sampling, clear_engines, get_engine
from specdec.decoding.timing import median_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(SHAPES), default="llama-1b")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.75, help="target acceptance of the generate calls")
    parser.add_argument("--compile", action="store_true", help="time the torch.compile'd steps")
    parser.add_argument("--backend", choices=("auto", "torch"), default="auto",
                        help="auto: the round commit (and sampler) as Triton kernels; torch: their torch references")
    parser.add_argument("--runner", choices=("auto", "native", "hf"), default="auto",
                        help="what runs the models' steps (compile needs hf)")
    parser.add_argument("--profile", action="store_true", help="print the kernels of one replayed round and the "
                        "host and device time of one call")
    parser.add_argument("--trace", default=None, help="with --profile: a folder for each batch's call's Chrome trace")
    args = parser.parse_args()
    runner = "hf" if args.compile else args.runner
    verifier, drafter = build_pair(args.model, 1)
    scale = DeepScale(verifier, 1)
    vocab, k, cuda = verifier.config.vocab_size, args.k, torch.device("cuda")
    greedy = Sampling(greedy=True, top_k=0, top_p=1.0)
    print("model,batch,K,t_verify_1_ms,t_verify_K+1_ms,t_draft_1_ms,t_draft_2_ms,round_0_ms,round_K_ms,"
          "model_round_ms,wider_verify_ms,wider_first_draft_ms,rest_ms,rounds,rounds_mean_row,prefill_ms,wall_round_ms")
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            engine = get_engine(verifier, drafter, batch, 512, vocab, k, 1, cuda, args.backend, True, args.compile,
                                runner=runner)
            times = {}
            for name, model, width in (("verify_1", engine.verifier, 1), ("verify_k", engine.verifier, k + 1),
                                       ("draft_1", engine.drafter, 1), ("draft_2", engine.drafter, 2)):
                ids = torch.zeros((batch, width), dtype=torch.int64, device=cuda)
                slots = 100 + torch.arange(width, device=cuda).expand(batch, width)
                step = engine._capture(lambda model=model, ids=ids, slots=slots, width=width:
                                       model.forward(ids, slots, width))
                times[name] = median_seconds(step, cuda, 30) * 1e3
            round0 = engine.round_seconds(0, greedy, 30) * 1e3
            round_k = engine.round_seconds(k, greedy, 30) * 1e3
            modelled = (k * times["draft_1"] / times["verify_1"] + 1) * times["verify_1"]
            rest = round_k - times["verify_k"] - times["draft_2"] - (k - 1) * times["draft_1"]
            prompts = torch.randint(100, vocab, (batch, 32), generator=torch.Generator().manual_seed(0)).cuda()
            calibrate(scale, verifier, drafter, prompts, args.alpha, 128)

            def call(prompts=prompts, new_tokens=128):
                return specdec.generate(verifier, drafter, prompts, max_new_tokens=new_tokens, num_draft_tokens=k,
                                        pad_token_id=0, compile=args.compile, backend=args.backend, runner=runner)

            def timed(new_tokens):
                torch.cuda.synchronize()
                begin = time.perf_counter()
                result = call(new_tokens=new_tokens)
                torch.cuda.synchronize()
                return result, time.perf_counter() - begin

            call()  # captures this call's rounds
            result, wall = timed(128)
            prefill = min(timed(1)[1] for _ in range(3))  # the prompt pass and the call's setup, no round (another
            # capacity bucket: its first call captures, the minimum leaves that out)
            stats = result.stats
            rounds = len(stats.draft_lengths)
            mean_row = float(stats.verifier_calls.double().mean()) - 1  # (the prompt's call samples token 1)
            print(f"{args.model},{batch},{k},{times['verify_1']:.3f},{times['verify_k']:.3f},{times['draft_1']:.3f},{times['draft_2']:.3f},"
                  f"{round0:.3f},{round_k:.3f},{modelled:.3f},{times['verify_k'] - times['verify_1']:.3f},"
                  f"{times['draft_2'] - times['draft_1']:.3f},{rest:.3f},{rounds},{mean_row:.1f},"
                  f"{prefill * 1e3:.3f},{(wall - prefill) / rounds * 1e3:.3f}", flush=True)
            if args.profile:
                replay = engine.step("round", k, greedy)
                engine._park()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        replay()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as prof:
                    call()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
                if args.trace:
                    os.makedirs(args.trace, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(args.trace, f"{args.model}_b{batch}_k{k}.json"))
            clear_engines()


if __name__ == "__main__":
    main()
