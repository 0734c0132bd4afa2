"""The cost ratio c measured on generate's decoding step, the measured wall-clock speed-up, and how the report and
its plots label measured against predicted figures.

No timing is asserted here: timings depend on the machine and its load (``benchmarks/tools/cost_ratio_repeatability.py``
shows how repeatable c is on a machine). What is asserted is exact: token counts, which calls ran, the labels, the
path and settings a measurement reports, and the order of the spread it reports.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.cli import demo_report
from specdec.cli.demo import DemoSettings
from specdec.cli.demo_report import comparison_figure
from specdec.fairness import (
    CostRatio,
    FairnessReport,
    TaskData,
    TaskFairness,
    evaluate,
    measure_decode_costs,
    measure_wall_clock_speedup,
    speed,
)

from models import tiny_llama as build_tiny_llama

VOCAB = 48
EOS = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    return build_tiny_llama(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, seed=seed, init_std=0.5)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(64, 4, seed=0), tiny_llama(16, 1, seed=1)


def token_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(3, 7, (count,),
                                                                                              generator=gen)]


def texts_only_tasks() -> dict[str, TaskData]:
    gen = torch.Generator().manual_seed(5)
    return {"a": TaskData(texts=[torch.randint(3, VOCAB, (10,), generator=gen).tolist() for _ in range(2)])}


# ------------------------------------------------------------------------------------------------- cost ratio c
def assert_spread_in_order(summary: dict) -> None:
    """The reported spread of the per-repetition ratios is ordered: min <= p20 <= median (c) <= p80 <= max."""
    assert summary["cost_ratio_min"] <= summary["cost_ratio_p20"] <= summary["cost_ratio"]
    assert summary["cost_ratio"] <= summary["cost_ratio_p80"] <= summary["cost_ratio_max"]


def test_evaluate_measures_the_cost_ratio_on_generate_s_decoding_step(models):
    verifier, drafter = models
    report = evaluate(verifier, drafter, texts_only_tasks(), batch_size=2, max_new_tokens=16, progress=False,
                      wall_clock=False)
    summary = report.summary
    assert summary["cost_ratio_source"] == "measured" and summary["cost_ratio_path"] == "eager"
    assert summary["cost_ratio_repeats"] == 10 and summary["cost_ratio_batch_size"] == 2
    assert summary["cost_ratio_new_tokens"] == 16
    assert summary["drafter_step_s"] > 0 and summary["verifier_step_s"] > 0
    assert_spread_in_order(summary)
    assert ("cost ratio c = " + format(summary["cost_ratio"], ".4g") + " (measured on the decoding step of "
            "specdec.generate, eager path, batch 2, median of 10 repetitions; p20–p80") in report.to_markdown()


def test_cost_ratio_is_measured_once_with_the_evaluation_s_settings(models, monkeypatch):
    # None is measured (new tokens clamped to [8, 32]); a number is labelled given; a CostRatio is kept as it is
    verifier, drafter = models
    calls = []
    measured = CostRatio(value=0.5, source="measured", repeats=3, path="eager", batch_size=4, new_tokens=8)

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return measured

    monkeypatch.setattr(speed, "measure_decode_costs", recording)
    for max_new_tokens, new_tokens in ((3, 8), (20, 20), (64, 32)):
        cost = speed.resolve_cost_ratio(None, verifier, drafter, batch_size=4, max_new_tokens=max_new_tokens,
                                        temperature=0.7, seed=5, vocab_size=40)
        assert cost is measured
        assert calls.pop() == {"batch_size": 4, "new_tokens": new_tokens, "temperature": 0.7, "seed": 5,
                               "vocab_size": 40, "backend": "auto"}
    given = speed.resolve_cost_ratio(0.25, verifier, drafter)
    assert given == CostRatio(value=0.25, source="given")
    assert speed.resolve_cost_ratio(given, verifier, drafter) is given
    assert calls == []
    with pytest.raises(TypeError, match="cost_ratio must be a float"):
        speed.resolve_cost_ratio("fast", verifier, drafter)


def test_measured_cost_ratio_reports_how_it_was_measured(models):
    verifier, drafter = models
    cost = measure_decode_costs(verifier, drafter, batch_size=2, new_tokens=16, repeats=5)
    assert cost.source == "measured" and cost.path == "eager"
    assert cost.repeats == 5 and cost.batch_size == 2 and cost.new_tokens == 16
    assert cost.drafter_step_s > 0 and cost.verifier_step_s > 0
    assert_spread_in_order(cost.summary())
    line = cost.describe()
    assert "eager path, batch 2, median of 5 repetitions" in line and "p20–p80" in line and "ms (verifier)" in line


def test_a_measured_cost_ratio_without_step_times_is_described():
    # a CostRatio built by hand (or read back without the step times): every description leaves the steps out
    cost = CostRatio(value=0.5, source="measured", ratio_min=0.4, ratio_p20=0.45, ratio_p80=0.55, ratio_max=0.6,
                     repeats=3, path="eager", batch_size=1, new_tokens=8)
    line = cost.describe()
    assert line.startswith("cost ratio c = 0.5 (measured on the decoding step") and "ms" not in line
    assert "p20–p80 0.45–0.55, min–max 0.4–0.6" in line
    info = {"drafter_parameters": 1_000, "verifier_parameters": 4_000}
    sentence = demo_report._speed_sentence(DemoSettings(wall_clock=False), cost, info, {})
    assert line in sentence and "--cost-ratio" not in sentence
    given = demo_report._speed_sentence(DemoSettings(), CostRatio(value=0.05), info, {})
    assert "cost ratio c = 0.05 (given), from the command line (--cost-ratio)" in given


def test_a_given_cost_ratio_wins_and_is_labelled_given(models, monkeypatch):
    verifier, drafter = models

    def no_measurement(*args, **kwargs):
        raise AssertionError("c was measured although it was given")

    monkeypatch.setattr(speed, "measure_decode_costs", no_measurement)
    report = evaluate(verifier, drafter, texts_only_tasks(), cost_ratio=0.25, progress=False, wall_clock=False)
    assert report.summary["cost_ratio"] == 0.25 and report.summary["cost_ratio_source"] == "given"
    assert "c = 0.25 (given)" in report.to_markdown() and "measured on the decoding step" not in report.to_markdown()
    assert json.loads(json.dumps(report.to_dict()))["summary"]["cost_ratio_source"] == "given"
    # a CostRatio measured once (as the demo does for all its drafters) keeps its label and spread
    measured = CostRatio(value=0.5, source="measured", drafter_step_s=1e-3, verifier_step_s=2e-3, ratio_min=0.45,
                         ratio_p20=0.48, ratio_p80=0.52, ratio_max=0.55, repeats=10, path="eager", batch_size=2,
                         new_tokens=16)
    again = evaluate(verifier, drafter, texts_only_tasks(), cost_ratio=measured, progress=False, wall_clock=False)
    assert again.summary["cost_ratio_source"] == "measured" and again.summary["cost_ratio_p80"] == 0.52
    assert "(given)" not in again.to_markdown() and "p20–p80 0.48–0.52" in again.to_markdown()


# ------------------------------------------------------------------------------------------ wall-clock speed-up
def test_greedy_wall_clock_compares_the_same_tokens(models):
    verifier, drafter = models
    prompts = token_prompts(5)
    # Greedy speculative decoding is lossless: with eos on, both methods emit exactly the same tokens, so the
    # measured speed-up is the ratio of the two times.
    timing = measure_wall_clock_speedup(verifier, drafter, prompts, num_draft_tokens=3, max_new_tokens=12,
                                        batch_size=2, repeats=1, eos_token_id=EOS)
    assert timing.speculative_tokens == timing.plain_tokens <= 5 * 12
    assert timing.speedup == pytest.approx(timing.plain_s / timing.speculative_s, rel=1e-9)
    assert timing.speedup_min == timing.speedup_max == timing.speedup and timing.repeats == 1
    # without eos both produce max_new_tokens for every prompt
    timing = measure_wall_clock_speedup(verifier, drafter, prompts, num_draft_tokens=3, temperature=0.8,
                                        max_new_tokens=6, batch_size=3, repeats=3)
    assert timing.speculative_tokens == timing.plain_tokens == 5 * 6
    assert timing.speedup_min <= timing.speedup <= timing.speedup_max and timing.speculative_s > 0


def test_plain_generate_is_the_verifier_decoding_greedily(models, monkeypatch):
    # what is timed as plain decoding must be the verifier's own greedy decoding of the same prompts: record the
    # call and compare its output with specdec.generate's (lossless, so equal)
    verifier, drafter = models
    seen = []
    original = type(verifier).generate

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append((kwargs, out))
        return out

    monkeypatch.setattr(type(verifier), "generate", recording)
    prompts = token_prompts(2, seed=3)
    measure_wall_clock_speedup(verifier, drafter, prompts, num_draft_tokens=2, max_new_tokens=5, batch_size=2,
                               repeats=1, warmup=0, eos_token_id=None)
    (kwargs, out), = seen
    assert kwargs["do_sample"] is False and kwargs["max_new_tokens"] == 5 and kwargs["eos_token_id"] is None
    from specdec.decoding.generation import generate
    from specdec.fairness.teacher_forcing import pad_batch

    ids, mask = pad_batch(prompts, 0, "left")
    torch.testing.assert_close(generate(verifier, drafter, ids, mask, max_new_tokens=5).sequences, out)


def test_specdec_baseline_is_plain_decoding_on_the_same_path(models, monkeypatch):
    # baseline="specdec" must time specdec.generate with no drafts (the verifier's greedy decoding, so the same
    # tokens as the speculative runs) and never the verifier's Hugging Face generate
    verifier, drafter = models
    generate_module = speed  # the module that calls specdec.generate
    calls = []
    original = generate_module.generate

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((kwargs["num_draft_tokens"], out))
        return out

    monkeypatch.setattr(generate_module, "generate", recording)
    prompts = token_prompts(3, seed=5)
    timing = measure_wall_clock_speedup(WithoutGenerate(verifier), drafter, prompts, num_draft_tokens=2,
                                        max_new_tokens=6, batch_size=3, repeats=1, warmup=0, eos_token_id=EOS,
                                        baseline="specdec")
    assert sorted(k for k, _ in calls) == [0, 2] and timing.baseline == "specdec"
    plain, speculative = (out for _, out in sorted(calls, key=lambda call: call[0]))
    torch.testing.assert_close(plain.sequences, speculative.sequences)
    assert timing.plain_tokens == timing.speculative_tokens == int(plain.stats.generated.sum())
    # the rounds alone: each side's rate after its first token, from the stats of the calls it timed
    for out in (plain, speculative):
        assert 0 < out.stats.time_to_first_token_s <= out.stats.wall_time_s
    rows = len(prompts)

    def rate_after_first(out):
        return (int(out.stats.generated.sum()) - rows) / (out.stats.wall_time_s - out.stats.time_to_first_token_s)

    assert timing.decode_speedup == pytest.approx(rate_after_first(speculative) / rate_after_first(plain), rel=1e-9)
    assert timing.plain_first_token_s == pytest.approx(plain.stats.time_to_first_token_s, rel=1e-9)
    assert timing.speculative_first_token_s == pytest.approx(speculative.stats.time_to_first_token_s, rel=1e-9)
    with pytest.raises(ValueError, match=r"baseline must be one of \('hf', 'specdec'\), got 'eager'"):
        measure_wall_clock_speedup(verifier, drafter, prompts, baseline="eager")
    tasks = {"x": TaskData(prompts=prompts)}
    report = evaluate(WithoutGenerate(verifier), drafter, tasks, num_draft_tokens=2, temperature=0.0,
                      max_new_tokens=4, batch_size=3, cost_ratio=0.2, progress=False, wall_clock_repeats=1,
                      wall_clock_baseline="specdec")
    assert report.summary["wall_clock_baseline"] == "specdec" and report.tasks[0].speedup_measured > 0
    assert report.tasks[0].speedup_measured_decode > 0 and report.tasks[0].first_token_seconds > 0
    assert report.summary["speedup_measured_decode_mean"] == report.tasks[0].speedup_measured_decode
    markdown = report.to_markdown()
    assert "S measured after the first token" in markdown.splitlines()[0]
    assert "S measured after the first token = the same ratio of rates" in markdown
    with pytest.raises(ValueError, match="wall_clock_baseline must be one of"):
        evaluate(verifier, drafter, tasks, cost_ratio=0.2, progress=False, wall_clock_baseline="eager")


def test_evaluate_reports_measured_beside_predicted(models, tmp_path):
    verifier, drafter = models
    gen = torch.Generator().manual_seed(1)
    tasks = {name: TaskData(prompts=token_prompts(3, seed=i), texts=[torch.randint(3, VOCAB, (9,), generator=gen)
                                                                         .tolist() for _ in range(2)])
             for i, name in enumerate(("x", "y"))}
    report = evaluate(verifier, drafter, tasks, num_draft_tokens=2, temperature=0.0, max_new_tokens=6, batch_size=2,
                      cost_ratio=0.3, progress=False, eos_token_id=EOS, wall_clock_repeats=2)
    for row in report.tasks:
        assert row.speedup_predicted is not None and row.speedup_predicted_generation is not None
        assert row.speedup_measured_min <= row.speedup_measured <= row.speedup_measured_max
        assert row.speculative_seconds > 0 and row.plain_seconds > 0
        assert row.speedup_measured_decode is None  # the verifier's own generate reports no first-token time
    summary = report.summary
    assert summary["wall_clock_measured"] is True
    assert summary["speedup_measured_min"] == min(r.speedup_measured for r in report.tasks)
    keys = set(report.to_dict()["tasks"][0])
    assert {"speedup_predicted", "speedup_predicted_generation", "speedup_measured"} <= keys
    assert "speedup" not in keys  # no unlabelled speed-up
    markdown = report.to_markdown()
    header = markdown.splitlines()[0]
    assert "S predicted" in header and "S measured (min–max)" in header and "S predicted from tok/call" in header
    assert "after the first token" not in header  # timed against the verifier's generate: no split
    assert "S measured = tokens per second of specdec.generate" in markdown
    off = evaluate(verifier, drafter, tasks, temperature=0.0, max_new_tokens=4, cost_ratio=0.3, progress=False,
                   wall_clock=False)
    assert all(r.speedup_measured is None for r in off.tasks) and off.summary["wall_clock_measured"] is False
    assert "S measured" not in off.to_markdown()


def test_generation_figures_come_from_the_timed_runs(models, monkeypatch):
    # With the wall clock, acceptance and tokens per call are read from the specdec.generate calls that were timed
    # (no extra run with other seeds); without it, the same calls with the same seeds run once: equal figures.
    verifier, drafter = models
    generate_module = speed
    original = generate_module.generate
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["seed"])
        return original(*args, **kwargs)

    monkeypatch.setattr(generate_module, "generate", counting)
    tasks = {"x": TaskData(prompts=token_prompts(3, seed=4))}  # two batches of at most 2
    options = {"num_draft_tokens": 2, "temperature": 1.0, "max_new_tokens": 6, "batch_size": 2, "cost_ratio": 0.3,
               "progress": False, "seed": 7}
    timed = evaluate(verifier, drafter, tasks, wall_clock_repeats=2, **options).tasks[0]
    assert len(calls) == 2 * (1 + 2)  # per batch: one warm-up and two timed calls, nothing else
    assert len(set(calls)) == 2  # one seed per batch, the same in every call
    seeds, calls[:] = set(calls), []
    untimed = evaluate(verifier, drafter, tasks, wall_clock=False, **options).tasks[0]
    assert len(calls) == 2 and set(calls) == seeds
    assert timed.speedup_measured is not None and untimed.speedup_measured is None
    assert timed.num_prompts == untimed.num_prompts == 3
    for field_name in ("alpha_measured", "acceptance_rate", "tokens_per_call", "speedup_predicted_generation"):
        assert getattr(timed, field_name) == getattr(untimed, field_name), field_name
    # the timing keeps the runs it timed, one per batch, in prompt order
    timing = measure_wall_clock_speedup(verifier, drafter, token_prompts(3, seed=4), num_draft_tokens=2,
                                        temperature=1.0, max_new_tokens=6, batch_size=2, repeats=1, seed=7)
    runs = timing.speculative_runs
    assert [run.output.sequences.shape[0] for run in runs] == [2, 1]
    assert sum(int(run.output.stats.generated.sum()) for run in runs) == timing.speculative_tokens


def test_report_warns_where_the_wall_clock_contradicts_the_prediction():
    rows = [TaskFairness(name="fast", speedup_predicted=1.6, speedup_measured=1.2),
            TaskFairness(name="flipped", speedup_predicted=1.4, speedup_measured=0.7),
            TaskFairness(name="slow", speedup_predicted=0.9, speedup_measured=0.5)]
    markdown = FairnessReport(tasks=rows, summary={"cost_ratio": 0.1, "cost_ratio_source": "given"}).to_markdown()
    assert "measured slower than plain decoding (S measured < 1) on 2 of 3 tasks: flipped, slow" in markdown
    assert "predicted faster (S predicted > 1) but measured slower on: flipped" in markdown


@pytest.mark.parametrize(("call", "kwargs", "error", "needle"), [
    ("cost", {"repeats": 0}, ValueError, "repeats must be an integer >= 1"),
    ("cost", {"new_tokens": 1}, ValueError, "new_tokens must be an integer >= 2"),
    ("cost", {"seq_len": 500, "new_tokens": 20}, ValueError, "exceeds the verifier's 512 positions"),
    ("cost", {"vocab_size": VOCAB + 1}, ValueError, "vocab_size"),
    ("cost", {"temperature": -1.0}, ValueError, "temperature"),
    ("cost", {"vocab_size": 0}, ValueError, "vocab_size"),
    ("speed", {"prompts": []}, ValueError, "prompts must be a non-empty list"),
    ("speed", {"prompts": [[3, 4], []]}, ValueError, "non-empty token-id lists"),
    ("speed", {"prompts": "3 4"}, TypeError, "prompts must be a list of token-id lists"),
    ("speed", {"prompts": 34}, TypeError, "prompts must be a list of token-id lists"),
    ("speed", {"prompts": [3, 4]}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    ("speed", {"prompts": [[3, 4], [3, "x"]]}, TypeError, r"prompts\[1\] must be a list of int token ids"),
    ("speed", {"prompts": [[3, 4.0]]}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    ("speed", {"prompts": [[3, VOCAB]]}, ValueError, r"prompts\[0\] has token ids outside \[0, 48\)"),
    ("speed", {"eos_token_id": VOCAB}, ValueError, "eos_token_id"),
    ("speed", {"vocab_size": VOCAB + 1}, ValueError, "vocab_size"),
    ("speed", {"repeats": 0}, ValueError, "repeats must be an integer >= 1"),
    ("speed", {"num_draft_tokens": 0}, ValueError, "num_draft_tokens"),
    ("speed", {"eos_token_id": "eos"}, TypeError, "eos_token_id"),
])
def test_bad_measurement_arguments(models, call, kwargs, error, needle):
    verifier, drafter = models
    with pytest.raises(error, match=needle):
        if call == "cost":
            measure_decode_costs(verifier, drafter, **kwargs)
        else:
            measure_wall_clock_speedup(verifier, drafter, **{"prompts": [[3, 4]], **kwargs})


def test_output_sizes_that_differ_need_vocab_size(models):
    verifier, _ = models
    wider = build_tiny_llama(vocab_size=VOCAB + 4, hidden_size=16, num_layers=1, seed=1, init_std=0.5)
    with pytest.raises(ValueError, match="pass vocab_size=48"):
        measure_decode_costs(verifier, wider, repeats=1, new_tokens=4)
    with pytest.raises(ValueError, match="pass vocab_size=48"):
        measure_wall_clock_speedup(verifier, wider, prompts=[[3, 4]], repeats=1)
    cost = measure_decode_costs(verifier, wider, repeats=1, new_tokens=4, vocab_size=VOCAB)
    assert cost.value > 0


def test_drafter_on_another_device_is_refused(models):
    verifier, drafter = models
    elsewhere = copy.deepcopy(drafter).to("meta")  # no memory, no compute: only its device differs
    with pytest.raises(ValueError, match="drafter is on meta but verifier is on cpu"):
        measure_decode_costs(verifier, elsewhere)


class WithoutGenerate(torch.nn.Module):
    """A causal LM without Hugging Face's generate method (a bare module with a config around one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def test_a_verifier_without_generate_is_refused_before_any_task_runs(models, monkeypatch):
    verifier, drafter = models
    from specdec.fairness import evaluation as fairness

    def no_work(*args, **kwargs):
        raise AssertionError("a task ran before the verifier's generate method was checked")

    monkeypatch.setattr(fairness, "task_divergences", no_work)
    tasks = {"texts first": texts_only_tasks()["a"], "with prompts": TaskData(prompts=token_prompts(2))}
    with pytest.raises(TypeError, match="verifier must have a Hugging Face generate method"):
        evaluate(WithoutGenerate(verifier), drafter, tasks, cost_ratio=0.1, progress=False)
    with pytest.raises(TypeError, match="verifier must have a Hugging Face generate method"):
        measure_wall_clock_speedup(WithoutGenerate(verifier), drafter, token_prompts(2))
    # texts only, or no wall clock: nothing needs the verifier's generate
    with pytest.raises(AssertionError, match="a task ran"):
        evaluate(WithoutGenerate(verifier), drafter, {"texts": texts_only_tasks()["a"]}, cost_ratio=0.1,
                 progress=False)
    with pytest.raises(AssertionError, match="a task ran"):
        evaluate(WithoutGenerate(verifier), drafter, tasks, cost_ratio=0.1, progress=False, wall_clock=False)


def test_bad_cost_ratio_and_wall_clock_arguments(models):
    verifier, drafter = models
    with pytest.raises(ValueError, match="cost_ratio must be a finite number >= 0"):
        CostRatio(value=float("nan"))
    with pytest.raises(ValueError, match="cost_ratio must be a finite number >= 0"):
        CostRatio(value=-0.5)
    for wrong in ("0.5", True, None):
        with pytest.raises(TypeError, match="cost_ratio must be a float"):
            CostRatio(value=wrong)
    assert CostRatio(value=1).value == 1.0 and isinstance(CostRatio(value=1).value, float)
    with pytest.raises(ValueError, match="source"):
        CostRatio(value=0.5, source="guessed")
    with pytest.raises(TypeError, match="wall_clock must be True or False"):
        evaluate(verifier, drafter, texts_only_tasks(), cost_ratio=0.1, wall_clock="yes", progress=False)


# ------------------------------------------------------------------------------------------------------- plots
def overlapping_legends(fig) -> list[str]:
    """Legends whose drawn box covers part of any panel's plotting area."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    found = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if box.overlaps(ax.get_window_extent(renderer)):
                found.append(f"legend {[t.get_text() for t in legend.get_texts()]} over {ax.get_title()!r}")
    return found


def has_line_at_one(ax) -> bool:
    return any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())


def example_report(measured: bool) -> FairnessReport:
    rows = []
    for i, name in enumerate(("en", "de", "bn", "zh")):
        rows.append(TaskFairness(
            name=name, alpha=0.9 - 0.2 * i, alpha_measured=0.85 - 0.2 * i, speedup_predicted=2.0 - 0.4 * i,
            bound_tv=1.9 - 0.4 * i, bound_pinsker=1.5 - 0.4 * i, speedup_predicted_generation=1.8 - 0.4 * i,
            speedup_measured=(1.5 - 0.4 * i) if measured else None, speedup_measured_min=(1.4 - 0.4 * i) if measured
            else None, speedup_measured_max=(1.6 - 0.4 * i) if measured else None, entropy=1.0, kl=0.1 + 0.3 * i,
            fitness=0.8 - 0.2 * i))
    return FairnessReport(tasks=rows, summary={"num_draft_tokens": 4, "cost_ratio": 0.2, "cost_ratio_source": "given",
                                               "spearman_fitness_speedup_predicted": 1.0})


def test_fairness_plot_keeps_legends_off_the_bars_and_marks_slowdowns(tmp_path):
    import matplotlib.pyplot as plt

    fig = example_report(measured=True)._figure()
    try:
        assert overlapping_legends(fig) == []
        speed = [ax for ax in fig.axes if ax.get_title().startswith("speed-up per task")]
        assert len(speed) == 1 and has_line_at_one(speed[0])
        labels = [t.get_text() for t in speed[0].get_legend().get_texts()]
        assert "measured (wall clock)" in labels and "predicted S(α_T)" in labels
        assert all(label.startswith(("predicted", "measured", "1 = no speed-up")) for label in labels)
        scatter = [ax for ax in fig.axes if ax.get_title().startswith("drafter fitness")]
        assert has_line_at_one(scatter[0])
    finally:
        plt.close(fig)
    path = example_report(measured=False).plot(str(tmp_path / "report.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_demo_comparison_plot_shows_measured_and_predicted_apart():
    import matplotlib.pyplot as plt

    reports = {"original": example_report(measured=True), "s-CDF": example_report(measured=True)}
    for report in reports.values():
        report.summary["U_ce"] = 0.1
    fig = comparison_figure(reports)
    try:
        assert overlapping_legends(fig) == []
        titles = [ax.get_title() for ax in fig.axes]
        predicted = fig.axes[titles.index(next(t for t in titles if t.startswith("predicted speed-up")))]
        measured = fig.axes[titles.index(next(t for t in titles if t.startswith("measured wall-clock")))]
        assert has_line_at_one(predicted) and has_line_at_one(measured)
        assert [t.get_text() for t in fig.legends[0].get_texts()][-2:] == ["original", "s-CDF"]
    finally:
        plt.close(fig)
    fig = comparison_figure({"original": example_report(measured=False)})
    try:  # nothing measured: no empty "measured" panel
        assert not any(ax.get_title().startswith("measured") for ax in fig.axes)
    finally:
        plt.close(fig)
