"""`specdec.generate` as a drop-in for transformers' `generate`: the same options with the same meanings on both
paths (static slot caches, eager dynamic caches). Greedy decoding with `repetition_penalty`, `min_new_tokens`,
`stop_strings`, `num_return_sequences` and a `generation_config` equals `verifier.generate` token for token (fp32);
a streamer receives exactly the new tokens; `logprobs` are the verifier's processed log-probabilities; sampling with
the processors follows the verifier's processed law (chi-square near 10 sigma); unsupported options are named."""

import inspect
import string

import pytest
import torch
from transformers import GenerationConfig, TextStreamer
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

import specdec
from specdec.decoding.hf_options import resolve_options
from specdec.decoding.processors import penalty_skips_left_padding, prompt_context

from models import byte_level_tokenizer, left_padded_prompts, perturbed_copy, tiny_llama
from stats import assert_follows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PATHS = pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton sampler)")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()  # tokens of several characters: stop strings can end inside a token


@pytest.fixture(scope="module")
def pair(tokenizer):
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.05, seed=1)
    return verifier.to(DEVICE), drafter.to(DEVICE)


def _hf_greedy(verifier, input_ids, attention_mask, **options):
    options = {"pad_token_id": 0, **options}
    return verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, **options)


def _stop_string(tokenizer, rows: torch.Tensor, first: int) -> str:
    """Two letters across a token boundary of a row, from position ``first`` on, whose second letter is not the last
    character of its token (so the stop string ends inside a token)."""
    letters = set(string.ascii_letters)
    for row in rows.tolist():
        texts = [tokenizer.decode([token]) for token in row]
        for index in range(max(first, 1), len(texts)):
            before, token = texts[index - 1], texts[index]
            if before[-1:] and before[-1] in letters and len(token) >= 2 and token[0] in letters:
                return before[-1] + token[0]
    raise AssertionError("no stop string candidate in the free-running output")


@pytest.fixture(scope="module")
def scenario(pair, tokenizer):
    """Ragged prompts and HF options under which each option changes transformers' greedy output (checked here)."""
    verifier, _ = pair
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], len(tokenizer), seed=4)
    input_ids, attention_mask = input_ids.to(DEVICE), attention_mask.to(DEVICE)
    width = input_ids.shape[1]
    plain = _hf_greedy(verifier, input_ids, attention_mask, max_new_tokens=20, eos_token_id=[])
    penalised = _hf_greedy(verifier, input_ids, attention_mask, max_new_tokens=20, eos_token_id=[],
                           repetition_penalty=1.5)
    assert not torch.equal(plain, penalised), "the penalty must change the output"
    eos = int(penalised[0, width + 1])  # row 0's second token: min_new_tokens must ban it
    stop = _stop_string(tokenizer, penalised[:, width:], first=5)
    options = {"max_new_tokens": 20, "repetition_penalty": 1.5, "min_new_tokens": 6, "eos_token_id": eos,
               "stop_strings": [stop], "tokenizer": tokenizer, "pad_token_id": 0}
    expected = _hf_greedy(verifier, input_ids, attention_mask, **options)
    for dropped in ("min_new_tokens", "stop_strings"):
        without = _hf_greedy(verifier, input_ids, attention_mask, **{k: v for k, v in options.items() if k != dropped})
        assert not torch.equal(without, expected), f"{dropped} must change the output"
    return input_ids, attention_mask, options, expected


@PATHS
@pytest.mark.parametrize("num_draft_tokens", [2, 5])
def test_greedy_with_hf_options_equals_transformers_generate(pair, scenario, num_draft_tokens, static):
    verifier, drafter = pair
    input_ids, attention_mask, options, expected = scenario
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, num_draft_tokens=num_draft_tokens,
                           static=static, **options)
    assert torch.equal(out.sequences, expected)
    assert out.stats.path == ("static" if static else "eager")
    assert int(out.stats.accepted.sum()) > 0, "drafts must be accepted under the processors"


@PATHS
def test_generation_config_and_num_return_sequences_equal_transformers(pair, tokenizer, scenario, static):
    verifier, drafter = pair
    input_ids, attention_mask, options, _ = scenario
    fields = {k: v for k, v in options.items() if k != "tokenizer"}
    config = GenerationConfig(do_sample=False, **fields)
    # transformers refuses greedy num_return_sequences > 1; its meaning is the prompts repeated row by row
    expected = verifier.generate(input_ids.repeat_interleave(2, dim=0),
                                 attention_mask=attention_mask.repeat_interleave(2, dim=0),
                                 generation_config=config, tokenizer=tokenizer)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, generation_config=config,
                           tokenizer=tokenizer, num_return_sequences=2, num_draft_tokens=3, static=static)
    assert torch.equal(out.sequences, expected)
    # explicit keywords override the config: a longer budget and no penalty
    longer = specdec.generate(verifier, drafter, input_ids, attention_mask, generation_config=config,
                              tokenizer=tokenizer, max_new_tokens=24, repetition_penalty=1.0, num_draft_tokens=3,
                              static=static)
    overridden = dict(fields, max_new_tokens=24, repetition_penalty=1.0)
    assert torch.equal(longer.sequences, _hf_greedy(verifier, input_ids, attention_mask, tokenizer=tokenizer,
                                                    **overridden))


class _Recorder:
    """transformers' streamer protocol: ``put(token_ids)``, ``end()``."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1


@PATHS
def test_a_streamer_receives_exactly_the_new_tokens_as_rounds_commit(pair, tokenizer, scenario, static, capsys):
    verifier, drafter = pair
    input_ids, attention_mask, options, _ = scenario
    prompt = input_ids[2:3, attention_mask[2].bool()]
    recorder = _Recorder()
    out = specdec.generate(verifier, drafter, prompt, streamer=recorder, num_draft_tokens=4, static=static, **options)
    generated = int(out.stats.generated[0])
    assert recorder.ends == 1 and torch.equal(recorder.puts[0], prompt.cpu())
    assert all(put.dim() == 2 and put.shape[0] == 1 for put in recorder.puts)
    streamed = torch.cat([put[0] for put in recorder.puts[1:]])
    assert torch.equal(streamed, out.sequences[0, prompt.shape[1]: prompt.shape[1] + generated].cpu())
    assert len(recorder.puts) - 1 == int(out.stats.verifier_calls[0]), "one put per verifier call"
    assert max(put.shape[1] for put in recorder.puts[1:]) > 1, "rounds commit several tokens at once"
    # transformers' TextStreamer prints what it prints for transformers' own generate
    _hf_greedy(verifier, prompt, None, streamer=TextStreamer(tokenizer), **options)
    printed_by_transformers = capsys.readouterr().out
    specdec.generate(verifier, drafter, prompt, streamer=TextStreamer(tokenizer), num_draft_tokens=4, static=static,
                     **options)
    assert capsys.readouterr().out == printed_by_transformers
    with pytest.raises(ValueError, match="streamer streams one sequence.*4 row"):
        specdec.generate(verifier, drafter, input_ids, attention_mask, streamer=_Recorder(), max_new_tokens=2)


@PATHS
def test_greedy_logprobs_equal_transformers_transition_scores(pair, scenario, static):
    verifier, drafter = pair
    input_ids, attention_mask, options, expected = scenario
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, num_draft_tokens=3, output_logprobs=True,
                           static=static, **options)
    hf = verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, return_dict_in_generate=True,
                           output_scores=True, **options)
    scores = verifier.compute_transition_scores(hf.sequences, hf.scores, normalize_logits=True)
    assert out.logprobs.shape == scores.shape == (input_ids.shape[0], expected.shape[1] - input_ids.shape[1])
    emitted = torch.arange(scores.shape[1], device=DEVICE)[None, :] < out.stats.generated.to(DEVICE)[:, None]
    assert torch.allclose(out.logprobs[emitted], scores[emitted], atol=1e-5)
    assert bool((out.logprobs[~emitted] == 0).all())
    assert specdec.generate(verifier, drafter, input_ids, attention_mask, static=static, **options).logprobs is None


def _processed_logprobs(verifier, prompt: torch.Tensor, new_tokens: torch.Tensor, penalty: float, min_new: int,
                        eos: int, temperature: float, padding: torch.Tensor) -> torch.Tensor:
    """[T] float64: log-probability of each new token of one row under transformers' processors (penalty, min new
    tokens, temperature), teacher-forced on the unpadded row; the penalty also sees the row's ``padding`` ids where
    the installed transformers penalises them."""
    sequence = torch.cat([prompt, new_tokens])
    with torch.no_grad():
        logits = verifier(sequence[None]).logits[0, prompt.shape[0] - 1: -1].double()
    penalised_prefix = padding[None] if not penalty_skips_left_padding() else padding[None, :0]
    repetition = RepetitionPenaltyLogitsProcessor(penalty)
    processors = [MinNewTokensLengthLogitsProcessor(prompt.shape[0], min_new, [eos], device=str(prompt.device)),
                  TemperatureLogitsWarper(temperature)]
    result = []
    for index, token in enumerate(new_tokens.tolist()):
        context = sequence[None, : prompt.shape[0] + index]
        scores = repetition(torch.cat([penalised_prefix, context], dim=1), logits[index][None])
        for processor in processors:
            scores = processor(context, scores)
        result.append(torch.log_softmax(scores[0], dim=-1)[token])
    return torch.stack(result)


@pytest.mark.parametrize("skip_left_padding", [True, False], ids=["unpadded-context", "padded-context"])
def test_the_penalty_context_is_what_transformers_penalises(skip_left_padding):
    # transformers' own processor on the padded rows, with or without prompt_ignore_length = the left padding
    input_ids, attention_mask = left_padded_prompts([3, 6, 1], 12, seed=2)
    padding = (attention_mask != 0).int().argmax(dim=1) if skip_left_padding else None
    penalty = RepetitionPenaltyLogitsProcessor(2.0)
    expected = []
    for row in range(3):
        start = int(padding[row]) if padding is not None else 0
        expected.append(penalty(input_ids[row: row + 1, start:], torch.ones(1, 12))[0] != 1.0)
    seen = prompt_context(input_ids, attention_mask, 12, skip_left_padding=skip_left_padding)
    assert torch.equal(seen[:, :12], torch.stack(expected))
    assert bool(seen[0, 0]) is not skip_left_padding  # row 0 has 3 pad ids (0); its prompt ids are at least 3


def test_the_penalty_context_follows_the_installed_transformers():
    from transformers.generation.utils import GenerationMixin
    source = inspect.getsource(GenerationMixin._get_logits_processor)
    assert penalty_skips_left_padding() == ("prompt_ignore_length" in source)


@PATHS
def test_sampled_logprobs_are_the_processed_verifier_law(pair, scenario, static):
    verifier, drafter = pair
    input_ids, attention_mask, options, _ = scenario
    options = {k: v for k, v in options.items() if k not in ("stop_strings", "tokenizer")}
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, num_draft_tokens=3, temperature=0.8,
                           seed=3, output_logprobs=True, static=static, **options)
    width = input_ids.shape[1]
    for row in range(input_ids.shape[0]):
        generated = int(out.stats.generated[row])
        mask = attention_mask[row].bool()
        reference = _processed_logprobs(verifier, input_ids[row, mask], out.sequences[row, width: width + generated],
                                        options["repetition_penalty"], options["min_new_tokens"],
                                        options["eos_token_id"], 0.8, input_ids[row, ~mask])
        assert torch.allclose(out.logprobs[row, :generated].double(), reference, atol=1e-4), row


VOCAB = 32


def _exact_three_token_laws(verifier, prompt, penalty, min_new, eos, temperature):
    """The laws of (x1, x2) and of (x2, x3), [V, V] each, under transformers' processors (float64, CPU)."""
    processors = [RepetitionPenaltyLogitsProcessor(penalty),
                  MinNewTokensLengthLogitsProcessor(prompt.shape[0], min_new, [eos], device=str(prompt.device)),
                  TemperatureLogitsWarper(temperature)]

    def law(contexts):
        with torch.no_grad():
            scores = verifier(contexts).logits[:, -1].float()
        for processor in processors:
            scores = processor(contexts, scores)
        return torch.softmax(scores.double(), dim=-1)

    ids = torch.arange(VOCAB, device=prompt.device)
    p1 = law(prompt[None])[0]
    one = torch.cat([prompt.expand(VOCAB, -1), ids[:, None]], dim=1)
    p2 = law(one)  # [x1, x2]
    two = torch.cat([one.repeat_interleave(VOCAB, dim=0), ids.repeat(VOCAB)[:, None]], dim=1)
    p3 = law(two).reshape(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    joint12 = p1[:, None] * p2
    return joint12.cpu(), (joint12[..., None] * p3).sum(dim=0).cpu()


def _check_processed_law(static: bool, rows: int, backend: str = "auto") -> None:
    # x1 comes from the prompt pass, x2 and x3 from the first round's positions 0 and 1: eos is banned for x1 and x2
    # only (min_new_tokens=2), and the penalty at position 1 must count the round's first draft (x2 = x3 is rarer)
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.1, seed=11).to(DEVICE)
    verifier.to(DEVICE)
    prompt = torch.tensor([5, 17, 30, 8, 17], device=DEVICE)
    with torch.no_grad():
        eos = int(verifier(prompt[None]).logits[0, -1].argmax())  # the likeliest first token
    penalty, temperature = 2.0, 0.9
    out = specdec.generate(verifier, drafter, prompt[None], max_new_tokens=3, num_draft_tokens=2,
                           temperature=temperature, repetition_penalty=penalty, min_new_tokens=2, eos_token_id=eos,
                           num_return_sequences=rows, seed=321, static=static, backend=backend)
    assert out.sequences.shape == (rows, prompt.shape[0] + 3)
    assert out.stats.path == ("static" if static else "eager")
    tokens = out.sequences[:, prompt.shape[0]:].cpu()
    joint12, joint23 = _exact_three_token_laws(verifier, prompt, penalty, 2, eos, temperature)
    assert float(joint23[:, eos].sum()) > 0.03 and float(joint12[eos].sum()) == 0.0, "eos allowed at x3 only"
    for first, what in ((0, "(x1, x2)"), (1, "(x2, x3)")):
        counts = torch.bincount(tokens[:, first] * VOCAB + tokens[:, first + 1], minlength=VOCAB * VOCAB)
        assert_follows(counts, (joint12 if first == 0 else joint23).flatten(), what=f"joint law of {what}")
    repeat = float(joint23.diagonal().sum())  # (the penalty's effect, tested alone for power)
    assert_follows(torch.bincount((tokens[:, 1] == tokens[:, 2]).long(), minlength=2),
                   torch.tensor([1 - repeat, repeat]), what="P(x3 = x2)")
    assert 0.05 < out.stats.total_acceptance_rate < 0.95


@PATHS
def test_sampling_with_processors_follows_the_processed_verifier_law(static):
    _check_processed_law(static, rows=6000)


@PATHS
def test_the_drafter_is_processed_exactly_as_the_verifier(pair, scenario, static):
    # with the verifier as its own drafter, q_j = p_j at every position only if the drafter sees the same context
    # (drafts before j) and count: then every draft is accepted, sampled or greedy
    verifier, _ = pair
    input_ids, attention_mask, options, _ = scenario
    options = {k: v for k, v in options.items() if k not in ("stop_strings", "tokenizer")}
    for temperature in (0.0, 1.0):
        out = specdec.generate(verifier, verifier, input_ids, attention_mask, num_draft_tokens=4,
                               temperature=temperature, seed=5, static=static, **options)
        stats = out.stats
        assert int(stats.drafted.sum()) > 40, temperature
        assert int(stats.accepted_per_position.sum()) == int(stats.attempted_per_position.sum()), temperature


def test_options_resolve_as_transformers_reads_them(pair):
    verifier, _ = pair
    resolve = lambda config=None, hf=None, **explicit: resolve_options(verifier, 5, config, explicit, hf or {})  # noqa: E731
    defaults = resolve()
    assert (defaults.max_new_tokens, defaults.temperature, defaults.top_k, defaults.top_p) == (128, 0.0, 0, 1.0)
    assert defaults.eos_token_id is None and defaults.repetition_penalty is None and defaults.stop_strings == ()
    # a config is completed from the verifier's generation_config (eos 2, pad 0) and transformers' defaults
    sampled = resolve(GenerationConfig(do_sample=True, temperature=0.7))
    assert (sampled.temperature, sampled.top_k, sampled.max_new_tokens) == (0.7, 50, 20 - 5)
    assert (sampled.eos_token_id, sampled.pad_token_id) == (2, 0)
    assert resolve(GenerationConfig(do_sample=False, temperature=0.7)).temperature == 0.0
    assert resolve(GenerationConfig(do_sample=True, temperature=0.7), temperature=0.0).temperature == 0.0
    assert resolve(hf={"do_sample": True}).temperature == 1.0
    assert resolve(hf={"do_sample": False}, temperature=0.5).temperature == 0.0
    assert resolve(GenerationConfig(max_new_tokens=9), hf={"max_length": 30}).max_new_tokens == 9
    assert resolve(hf={"max_length": 30}).max_new_tokens == 25
    assert resolve(hf={"min_length": 9}, min_new_tokens=2).min_new_tokens == 4
    assert resolve(GenerationConfig(eos_token_id=7), eos_token_id=[]).eos_token_id == []
    assert resolve(stop_strings="x").stop_strings == ("x",)
    no_effect = {"use_cache": True, "return_dict_in_generate": True, "num_beams": 1, "output_scores": False,
                 "synced_gpus": False, "logits_processor": None}
    assert resolve(hf=no_effect) == defaults


@pytest.mark.parametrize("hf_options, message", [
    ({"num_beams": 4}, "num_beams=4"),
    ({"no_repeat_ngram_size": 2, "top_h": 0.5}, "no_repeat_ngram_size=2, top_h=0.5"),
    ({"logits_processor": []}, "logits_processor=\\[\\]"),
    ({"output_scores": True}, "output_scores=True"),
    ({"generation_config": GenerationConfig(num_beams=2, max_new_tokens=3)}, "num_beams=2"),
    ({"do_sample": True, "temperature": 0.0}, "do_sample=True needs temperature > 0"),
    ({"max_length": 4}, "max_length=4 leaves no new token"),
    ({"stop_strings": ["ab"]}, "stop_strings needs tokenizer="),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite float > 0"),
    ({"min_new_tokens": -1}, "min_new_tokens must be"),
    ({"num_return_sequences": 0}, "num_return_sequences must be"),
])
def test_unsupported_or_bad_hf_options_are_named(pair, hf_options, message):
    verifier, drafter = pair
    input_ids = torch.tensor([[5, 6, 7, 8, 9]], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        specdec.generate(verifier, drafter, input_ids, **hf_options)


def test_unknown_keywords_and_bad_types_are_type_errors(pair):
    verifier, drafter = pair
    input_ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    for options, message in (({"frobnicate": 1}, "unexpected keyword argument.*frobnicate"),
                             ({"generation_config": {"max_new_tokens": 3}}, "generation_config must be"),
                             ({"streamer": object()}, "streamer must have put"),
                             ({"output_logprobs": 1}, "output_logprobs must be True or False")):
        with pytest.raises(TypeError, match=message):
            specdec.generate(verifier, drafter, input_ids, max_new_tokens=2, **options)


@GPU
def test_gpu_triton_sampler_and_compiled_rounds_keep_the_hf_options_exact(pair, scenario):
    verifier, drafter = pair
    input_ids, attention_mask, options, expected = scenario
    for num_draft_tokens, compile_models in ((3, True), ("auto", False)):
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, num_draft_tokens=num_draft_tokens,
                               output_logprobs=True, compile=compile_models,
                               runner="hf" if compile_models else "auto", **options)
        assert out.stats.path == "static" and out.stats.compiled == compile_models
        assert out.stats.runner == ("hf" if compile_models else "native")
        assert torch.equal(out.sequences, expected)
    for static in (False, True):
        _check_processed_law(static, rows=50000, backend="triton")
