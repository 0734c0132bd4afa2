"""specdec.fairness: per-task metrics, bounds, report formats, per-character figures and argument checks."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.fairness.evaluation import (
    FairnessReport,
    TaskData,
    TaskFairness,
    _check_bounds,
    divergences_from_logits,
    encode_items,
    evaluate,
    spearman,
    task_divergences,
    unfairness,
)
from specdec.fairness.metrics import acceptance_from_logits, speedup

from models import tiny_llama as build_tiny_llama

VOCAB = 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    return build_tiny_llama(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, seed=seed, init_std=0.5)


class CharTokenizer:
    """Characters -> ids; characters of ``fragmented`` take two tokens each (a script the tokenizer fragments)."""

    def __init__(self) -> None:
        self.chars = "abcdefghijklmnopqrstuvwxyz "
        self.fragmented = "αβγδεζηθ"
        self.pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [] if not add_special_tokens else [1]
        for ch in text:
            if ch in self.fragmented:
                ids += [30 + self.fragmented.index(ch), 40 + self.fragmented.index(ch) % 8]
            else:
                ids.append(3 + self.chars.index(ch))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = []
        for t in ids:
            if t in (1, 2) and not skip_special_tokens:
                out.append(("<s>", "</s>")[t - 1])  # as Hugging Face tokenizers render bos / eos
            elif 3 <= t < 3 + len(self.chars):
                out.append(self.chars[t - 3])
            elif 30 <= t < 38:
                out.append(self.fragmented[t - 30])
        return "".join(out)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(32, 2, seed=0), tiny_llama(16, 1, seed=1)


def token_tasks(seed: int = 0) -> dict[str, TaskData]:
    gen = torch.Generator().manual_seed(seed)
    texts = {name: [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in (9, 12, 7)]
             for name in ("a", "b", "c")}
    return {name: TaskData(prompts=[t[:4] for t in tt], texts=tt) for name, tt in texts.items()}


def test_per_task_metrics_match_definitions(models):
    verifier, drafter = models
    tasks = token_tasks()
    report = evaluate(verifier, drafter, tasks, num_draft_tokens=3, temperature=1.0, max_new_tokens=5,
                      batch_size=2, cost_ratio=0.2, progress=False, seed=0, wall_clock=False)
    assert [r.name for r in report.tasks] == ["a", "b", "c"]
    for row in report.tasks:
        texts = tasks[row.name].texts
        # alpha_T recomputed directly: every prefix of every text, one text at a time
        alphas, ces, kls, entropies = [], [], [], []
        for t in texts:
            ids = torch.tensor([t])
            with torch.no_grad():
                lv, ld = verifier(input_ids=ids).logits[0, :-1], drafter(input_ids=ids).logits[0, :-1]
            alphas.append(acceptance_from_logits(lv, ld))
            log_p, log_q = torch.log_softmax(lv.double(), -1), torch.log_softmax(ld.double(), -1)
            ces.append(-(log_p.exp() * log_q).sum(-1))
            kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
            entropies.append(-(log_p.exp() * log_p).sum(-1))
        alpha = torch.cat(alphas).double().mean().item()
        assert row.num_tokens == sum(len(t) - 1 for t in texts)
        assert row.alpha == pytest.approx(alpha, abs=1e-5)
        # K_T, D_T and H_T(p) against float64 sums written out here (not through the library's divergences)
        assert row.cross_entropy == pytest.approx(torch.cat(ces).mean().item(), abs=1e-4)
        assert row.kl == pytest.approx(torch.cat(kls).mean().item(), abs=1e-4)
        assert row.entropy == pytest.approx(torch.cat(entropies).mean().item(), abs=1e-4)
        assert row.alpha == pytest.approx(1 - row.tv, abs=1e-5)
        assert row.cross_entropy == pytest.approx(row.entropy + row.kl, abs=1e-5)
        assert row.speedup_predicted == pytest.approx(float(speedup(row.alpha, 3, 0.2)), rel=1e-6)
        assert row.speedup_predicted_prefix_mean >= row.bound_tv - 1e-6 >= row.bound_pinsker - 2e-6
        assert 1 - row.r_q - row.r_p - 1e-6 <= row.alpha <= 1 - row.r_q + row.r_p + 1e-6
        assert row.fitness == pytest.approx(1 - row.r_q)
        assert row.num_prompts == 3 and 0 <= row.alpha_measured <= 1
        assert 1 <= row.tokens_per_call <= 4
    s = report.summary
    assert s["U_ce"] == pytest.approx(unfairness([r.cross_entropy for r in report.tasks]))
    assert s["U_kl"] == pytest.approx(unfairness([r.kl for r in report.tasks]))
    assert s["alpha_min"] == min(r.alpha for r in report.tasks)
    assert s["alpha_max_over_min"] == pytest.approx(s["alpha_max"] / s["alpha_min"])
    assert s["speedup_predicted_std"] == pytest.approx(torch.tensor([r.speedup_predicted for r in report.tasks]).std(
        unbiased=False).item(), rel=1e-5)
    assert s["bound_violations"] == [] and s["bounds_checked"]
    assert s["worst_task"] == min(report.tasks, key=lambda r: r.alpha).name
    assert -1 <= s["spearman_fitness_speedup_predicted"] <= 1
    assert s["cost_ratio"] == 0.2 and s["cost_ratio_source"] == "given" and "cost_ratio_p20" not in s


def test_identical_drafter_accepts_everything(models):
    verifier, _ = models
    drafter = copy.deepcopy(verifier)
    report = evaluate(verifier, drafter, token_tasks(), num_draft_tokens=2, max_new_tokens=6, batch_size=3,
                      cost_ratio=0.5, progress=False, wall_clock=False)
    for row in report.tasks:
        assert row.alpha == pytest.approx(1.0, abs=1e-5)
        assert row.kl == pytest.approx(0.0, abs=1e-5)
        assert row.alpha_measured == 1.0
        # every draft accepted: K + 1 tokens per round, S = (K + 1) / (K c + 1) = 3 / 2
        assert row.speedup_predicted == pytest.approx(1.5, rel=1e-4)
        assert row.tokens_per_call_predicted == pytest.approx(3.0, rel=1e-4)
    assert report.summary["U_kl"] == pytest.approx(0.0, abs=1e-9)
    assert report.summary["cost_ratio"] == 0.5 and report.summary["cost_ratio_source"] == "given"


def test_report_formats_and_plot(models, tmp_path):
    verifier, drafter = models
    report = evaluate(verifier, drafter, token_tasks(), max_new_tokens=4, cost_ratio=0.0, progress=False,
                      wall_clock=False)
    d = report.to_dict()
    json.dumps(d)
    assert {row["name"] for row in d["tasks"]} == {"a", "b", "c"}
    md = report.to_markdown()
    assert "| a |" in md and "U_ce" in md and "bounds checked: all hold" in md
    path = report.plot(str(tmp_path / "report.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_per_character_figures_with_a_fragmenting_tokenizer(models):
    verifier, drafter = models
    tok = CharTokenizer()
    tasks = {"latin": {"texts": ["abc def ghi jkl", "mnop qrs"], "prompts": ["abc", "de f"]},
             "greek": {"texts": ["αβγ δεζ ηθα", "βγδ εζη"], "prompts": ["αβ", "γδ"]}}
    report = evaluate(verifier, drafter, tasks, tokenizer=tok, max_new_tokens=4, cost_ratio=0.1, progress=False,
                      wall_clock=False)
    latin, greek = report.task("latin"), report.task("greek")
    assert latin.chars_per_token == pytest.approx(1.0)
    assert greek.chars_per_token < 0.6  # two tokens per Greek letter
    assert greek.char_speedup_predicted == pytest.approx(greek.speedup_predicted * greek.chars_per_token)
    assert latin.chars_per_call is not None and greek.chars_per_call is not None
    assert "char_speedup_predicted_max_over_min" in report.summary


def test_character_counts_leave_out_special_tokens():
    # an emitted eos or a bos in a token-id list is no text: counted as '</s>' it would inflate chars/call
    tok = CharTokenizer()
    _, chars = encode_items([[1, 3, 4, 5, 2], [3, 4]], tok, "texts", True)
    assert chars == [3, 2]


def test_greedy_and_text_only_and_prompt_only(models):
    verifier, drafter = models
    tasks = token_tasks()
    texts_only = {"a": tasks["a"].texts, "b": {"texts": tasks["b"].texts}}
    report = evaluate(verifier, drafter, texts_only, temperature=0.0, cost_ratio=0.1, progress=False)
    for row in report.tasks:
        assert row.alpha_measured is None and row.num_prompts == 0
        assert 0.0 <= row.alpha <= 1.0
    assert report.summary["bounds_checked"] is False
    # TV_T and D_T are taken at T = 1 when greedy: no bound on the greedy S_T is claimed or printed
    assert all(row.bound_tv is None and row.bound_pinsker is None for row in report.tasks)
    markdown = report.to_markdown()
    assert "bounds checked: not checked" in markdown and "all hold" not in markdown and "S Pinsker" not in markdown
    prompts_only = evaluate(verifier, drafter, {"a": {"prompts": tasks["a"].prompts}}, cost_ratio=0.1,
                            max_new_tokens=3, progress=False, wall_clock=False)
    assert prompts_only.tasks[0].alpha is None and prompts_only.tasks[0].alpha_measured is not None
    assert "U_ce" not in prompts_only.summary
    divs = task_divergences(verifier, drafter, {"a": tasks["a"].texts}, batch_size=2)
    assert divs["a"].num_tokens == report.task("a").num_tokens


def test_verifier_entropy_is_finite_where_the_drafter_gives_a_token_probability_zero():
    # a -inf drafter logit on a token the verifier can emit (top-k / top-p filtering): H(p, q) = KL = +inf, but
    # H(p) is finite; computed as H(p, q) - KL it would be NaN
    generator = torch.Generator().manual_seed(3)
    verifier_logits = torch.randn(3, 12, generator=generator, dtype=torch.float64)
    drafter_logits = torch.randn(3, 12, generator=generator, dtype=torch.float64)
    drafter_logits[0, :4] = float("-inf")
    out = divergences_from_logits(verifier_logits.float(), drafter_logits.float(), torch.zeros(3, dtype=torch.int64),
                                  temperature=0.8, backend="torch")
    p = torch.softmax(verifier_logits / 0.8, -1)
    expected = -(p * p.log()).sum(-1)
    assert math.isinf(float(out.cross_entropy[0])) and math.isinf(float(out.kl[0]))
    torch.testing.assert_close(out.entropy.double(), expected, rtol=1e-5, atol=1e-5)


def test_bound_violations_are_recorded_not_raised():
    row = TaskFairness(name="x", alpha=0.9, speedup_predicted=1.0, speedup_predicted_prefix_mean=1.0, tv=0.1, kl=0.01,
                       r_q=0.5, r_p=0.1, bound_tv=2.0, bound_pinsker=3.0)
    violations = _check_bounds(row, temperature=1.0)
    assert len(violations) == 4 and all(v.startswith("x:") for v in violations)
    report = FairnessReport(tasks=[row], summary={"bound_violations": violations, "num_draft_tokens": 4})
    assert "4 violated" in report.to_markdown()


def test_unfairness_and_spearman():
    assert unfairness([1.0, 3.0]) == 1.0
    assert unfairness({"a": 2.0}) == 0.0
    assert unfairness(torch.tensor([0.0, 1.0, 2.0])) == pytest.approx(2 / 3)
    assert unfairness([1.0, float("inf")]) == float("inf")
    with pytest.raises(ValueError, match="NaN"):
        unfairness([1.0, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        unfairness(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="numbers"):
        unfairness(["a", "b"])
    assert spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert spearman([1, 2, 2], [3, 2, 1]) == pytest.approx(-math.sqrt(3) / 2)
    assert spearman([1], [2]) is None and spearman([1, 1], [1, 2]) is None
    with pytest.raises(ValueError, match="values"):
        unfairness([])
    with pytest.raises(TypeError, match="values"):
        unfairness(3.0)
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2], [1])


@pytest.mark.parametrize(("tasks", "kwargs", "error", "needle"), [
    ([1, 2], {}, TypeError, "tasks must be a mapping"),
    ({}, {}, ValueError, "at least one task"),
    ({"a": {"texts": ["hello"]}}, {}, ValueError, "tokenizer"),
    ({"a": {"other": [[1, 2]]}}, {}, ValueError, "keys"),
    ({"a": {"texts": []}}, {}, ValueError, "empty"),
    ({"a": TaskData()}, {}, ValueError, "neither"),
    ({"a": 5}, {}, TypeError, r"tasks\['a'\]"),
    ({"a": [[1, 2.5]]}, {}, TypeError, "token ids"),
    ({"a": [[3, 4, 5]]}, {"num_draft_tokens": 0}, ValueError, "num_draft_tokens"),
    ({"a": [[3, 4, 5]]}, {"batch_size": 0}, ValueError, "batch_size"),
    ({"a": [[3, 4, 5]]}, {"cost_ratio": -1.0}, ValueError, "cost_ratio"),
    ({"a": [[3, 4, 5]]}, {"cost_ratio": "fast"}, TypeError, "cost_ratio"),
    ({"a": [[3, 4, 5]]}, {"wall_clock_repeats": 0}, ValueError, "wall_clock_repeats must be an integer >= 1"),
    ({"a": [[3, 4, 5]]}, {"temperature": -1.0}, ValueError, "temperature"),
    ({"a": [[3, 4, 5]]}, {"backend": "cuda"}, ValueError, "backend"),
    ({"a": [[3, 4, 5]]}, {"tokenizer": object()}, TypeError, "tokenizer"),
    ({"a": [[3]]}, {}, ValueError, "at least 2 tokens"),
    ({"a": [[3, VOCAB, 5]]}, {}, ValueError, r"tasks\['a'\].texts\[0\] has token ids outside"),
    ({"a": [[3, -1, 5]]}, {}, ValueError, "token ids outside"),
    ({"a": [[3, 40, 5]]}, {"vocab_size": 32}, ValueError, "token ids outside \\[0, 32\\)"),
    ({"a": {"prompts": [[3, 4], [3, VOCAB]]}}, {}, ValueError, r"tasks\['a'\].prompts\[1\] has token ids outside"),
    ({"a": [[3, 4, 5]]}, {"vocab_size": 32.0}, ValueError, "vocab_size"),
    ({"a": [[3, 4, 5]]}, {"vocab_size": 0}, ValueError, "vocab_size"),
    ({"a": [[3, 4, 5]]}, {"vocab_size": VOCAB + 1}, ValueError, "vocab_size"),
    ({"a": [[3, 4, 5], [3, 4]]}, {"pad_token_id": -1}, ValueError, "pad_token_id"),
])
def test_bad_inputs(models, tasks, kwargs, error, needle):
    verifier, drafter = models
    with pytest.raises(error, match=needle):
        evaluate(verifier, drafter, tasks, progress=False, cost_ratio=kwargs.pop("cost_ratio", 0.1), wall_clock=False,
                 **kwargs)


def test_bad_models():
    with pytest.raises(TypeError, match="verifier"):
        evaluate("gpt", tiny_llama(16, 1, 0), {"a": [[3, 4]]}, progress=False)


def test_evaluate_warns_about_unknown_tokens_and_refuses_unexplained_output_sizes():
    import specdec
    from specdec import data

    tokenizer = data.build_char_tokenizer()
    verifier = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=1)
    tasks = {"en": TaskData(texts=["the cat sat on the mat"] * 2), "bn": TaskData(texts=["আমি বাংলায় গান গাই"] * 2)}
    with pytest.warns(specdec.SpecdecWarning, match=r"task 'bn': .*% of its .*tokens are"):
        evaluate(verifier, drafter, tasks, tokenizer=tokenizer, cost_ratio=0.5, progress=False, wall_clock=False)
    wider = build_tiny_llama(vocab_size=len(tokenizer) + 50, hidden_size=32, num_layers=1, seed=2)
    with pytest.raises(ValueError, match="pass vocab_size="):
        evaluate(verifier, wider, {"en": tasks["en"]}, tokenizer=tokenizer, cost_ratio=0.5, progress=False,
                 wall_clock=False)
    report = evaluate(verifier, wider, {"en": tasks["en"]}, tokenizer=tokenizer, cost_ratio=0.5, progress=False,
                      wall_clock=False, vocab_size=len(tokenizer))
    row = report.tasks[0]  # compared on the shared ids: a distribution over them, so alpha in (0, 1]
    assert row.name == "en" and row.num_tokens > 0 and 0.0 < row.alpha <= 1.0
