"""The multilingual pipeline's ``large`` preset, its n-gram drafter kind and its seconds caps, on a CPU.

The ``large`` preset is checked without training: its settings validate and its verifier's parameter count, built on
the meta device and recomputed from the architecture's shapes, is in the intended range. The n-gram drafter runs
through the smoke pipeline on small data in the shared folder's formats (the pipeline test's writer): prepare,
evaluate beside a model drafter, finetune (its other variants skipped with a printed reason), report. A tiny
``stage_max_seconds`` stops the train and finetune stages after their first unit of work, and their rows say what
was left out.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from multilingual import config as ml_config  # noqa: E402
from multilingual.models import build_model  # noqa: E402
from multilingual.pipeline import main  # noqa: E402
from multilingual.report import load_rows  # noqa: E402

from specdec.fairness.report import format_number  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

sys.path.insert(0, str(ROOT / "tests"))
from test_multilingual_pipeline import LANGS, smoke_settings, write_small_data  # noqa: E402


def _llama_parameters(spec: ml_config.ModelSpec, vocab: int) -> int:
    """A tied-embedding Llama's parameter count from its shapes: embeddings, per layer the q/k/v/o projections,
    the gated MLP and two RMS norms, and the final norm."""
    head_dim = spec.hidden_size // spec.num_heads
    attention = 2 * spec.hidden_size * spec.hidden_size + 2 * spec.hidden_size * spec.num_kv_heads * head_dim
    layer = attention + 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size
    return vocab * spec.hidden_size + spec.num_layers * layer + spec.hidden_size


def test_the_large_preset_has_a_deep_verifier_and_shallow_drafters():
    cfg = ml_config.build_config("large")  # build_config checks the settings
    cfg.check()
    assert cfg.preset == "large" and cfg.verifier.arch == "llama"
    with torch.device("meta"):
        verifier = build_model(cfg.verifier, cfg.vocab_size, cfg.max_positions, seed=0)
    params = sum(p.numel() for p in verifier.parameters())  # the tied head is one parameter
    assert verifier.config.tie_word_embeddings
    assert params == _llama_parameters(cfg.verifier, cfg.vocab_size)
    assert 150e6 <= params <= 400e6
    assert cfg.verifier.num_kv_heads < cfg.verifier.num_heads  # grouped-query attention
    assert 2.5 <= cfg.verifier.intermediate_size / cfg.verifier.hidden_size <= 3.0
    # c is about the drafter's layers over the verifier's: at most 2 of 24
    kinds = {spec.name: spec.kind for spec in cfg.drafters}
    assert sorted(kinds.values()) == ["ngram", "self", "trained", "trained"]
    for spec in cfg.drafters:
        layers = {"trained": spec.num_layers, "self": spec.self_layers, "ngram": 0}[spec.kind]
        assert layers <= 2 and layers / cfg.verifier.num_layers <= 0.1, spec.name
    # the training estimate: 6 * params * tokens at 35% of 990 TFLOP/s stays under 4 minutes
    tokens = cfg.verifier.steps * cfg.verifier.batch_size * cfg.seq_len
    assert 6 * params * tokens / (0.35 * 990e12) < 240
    assert tokens <= 3 * 5.0e6  # at most about three passes over the 5M-token corpus
    assert cfg.train_max_seconds is not None and cfg.train_max_seconds <= 240
    # its models are kept whole on the device: the embedding alone is larger than the full preset's 15 MB files
    assert cfg.vocab_size * cfg.verifier.hidden_size * 2 / 1e6 < cfg.max_file_mb
    key = ["none", "uniform_kd", "scdf_kl", "scdf_char_kl", "scdf_kl_mix50", "scdf_char_kl_mix50"]
    assert cfg.variants[: len(key)] == key and len(set(cfg.variants)) == len(cfg.variants)
    assert "ngram" in [d.name for d in ml_config.build_config("full").drafters]


def test_ngram_drafter_settings_are_checked():
    base = ml_config.smoke_preset()
    drafters = [d for d in base["drafters"] if d["name"] != "ngram"]
    for bad, message in (({"max_ngram": 0}, r"drafters\[3\].max_ngram must be .*>= 1"),
                         ({"max_ngram": 2, "min_ngram": 3}, r"drafters\[3\].min_ngram must be at most max_ngram=2"),
                         ({"max_ngram": 2, "self_layers": 1}, r"drafters\[3\]: an n-gram drafter .* self_layers "
                                                              r"must be null")):
        with pytest.raises(ValueError, match=message):
            ml_config.build_config("smoke", overrides={"drafters": drafters + [{"name": "ng", **bad}]})
    with pytest.raises(ValueError, match="verifier.self_layers and verifier.max_ngram must be null"):
        ml_config.build_config("smoke", overrides={"verifier": {**base["verifier"], "max_ngram": 3}})
    with pytest.raises(ValueError, match="stage_max_seconds must be a finite number > 0"):
        ml_config.build_config("smoke", overrides={"stage_max_seconds": 0})
    cfg = ml_config.build_config("smoke")
    assert [s.name for s in cfg.trained_models] == ["verifier", "small-skewed", "tiny-en"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, one_torch_thread):
    """The smoke preset on small data in the shared folder's formats: prepared, and the verifier trained."""
    root = tmp_path_factory.mktemp("multilingual-ngram")
    data = root / "data"
    write_small_data(data)
    work, results = root / "work", root / "results"
    common = ["--work", str(work), "--results", str(results), "--no-progress", "--device", "cpu"]
    assert main(["prepare", "--data", str(data), *smoke_settings(data)[:6], *common]) == 0
    assert main(["train", "--models", "verifier", *common]) == 0
    return {"work": work, "results": results, "common": common}


def test_the_ngram_drafter_runs_through_the_pipeline(real_run, capsys):
    common = real_run["common"]
    assert main(["evaluate", "--pairs", "self1,ngram", *common]) == 0
    finetuned = real_run["results"].parent / "results-finetune"
    assert main(["finetune", "--pairs", "ngram", "--variants", "none,uniform_kd,scdf_kl", *common[:2], "--results",
                 str(finetuned), *common[4:]]) == 0
    assert "ngram: skipping variants ['uniform_kd', 'scdf_kl']: an n-gram drafter has no weights to finetune" in \
        capsys.readouterr().err
    (summary,) = [r for r in load_rows(finetuned) if r["kind"] == "summary"]
    assert summary["pair"] == "ngram" and summary["variant"] == "none" and summary["finetune_steps"] == 0
    assert main(["report", "--results", str(real_run["results"]), "--no-plots"]) == 0
    rows = load_rows(real_run["results"])
    ngram = [r for r in rows if r.get("pair") == "ngram"]
    assert {r["variant"] for r in ngram} == {"none"}
    summaries = [r for r in ngram if r["kind"] == "summary"]
    assert len(summaries) == 1 and all(r["drafter_kind"] == "ngram" and r["finetune_steps"] == 0
                                       and r["drafter_weights_sha256"] is None for r in summaries)
    tasks = [r for r in ngram if r["kind"] == "task"]
    assert {r["task"] for r in tasks} == set(LANGS)
    assert all(0 <= r["alpha"] <= 1 and r["speedup_measured"] > 0 for r in tasks)
    assert all(r["tv"] == pytest.approx(1 - r["alpha"]) for r in tasks)  # a one-hot drafter: TV = 1 - alpha
    assert all(r["data_share"] is None for r in tasks)  # it learnt from no data
    assert 0 < summaries[-1]["cost_ratio"] < 1
    report = (real_run["results"] / "report.md").read_text(encoding="utf-8")
    assert "### Pair: verifier + ngram" in report
    side = report.split("Drafters as trained (variant none), side by side:")[1].split("α_T per task")[0]
    lines = {line.split(" | ")[0].strip("| "): line for line in side.splitlines() if line.startswith("| ")}
    assert {"self1", "ngram"} <= set(lines)
    for pair in ("self1", "ngram"):
        measured = [r["speedup_measured"] for r in rows if r["kind"] == "task" and r["pair"] == pair]
        cells = lines[pair].strip("| ").split(" | ")
        assert len(measured) == len(LANGS)
        assert format_number(statistics.pstdev(measured)) in cells  # the spread across languages
        assert format_number(max(measured) / min(measured)) in cells


def test_a_tiny_seconds_cap_stops_a_stage_after_its_first_unit(real_run, tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    shutil.copytree(real_run["work"], work)  # the capped training replaces the verifier: on a copy
    common = ["--work", str(work), "--results", str(results), "--no-progress", "--device", "cpu", "--set",
              "stage_max_seconds=0.001"]
    assert main(["train", "--models", "verifier,small-skewed", *common]) == 0
    rows = load_rows(results)
    (trained,) = [r for r in rows if r["kind"] == "train"]
    assert trained["model"] == "verifier" and trained["steps_run"] == 1 < trained["steps"]
    assert trained["cut_by"] == "stage_max_seconds"
    (stopped,) = [r for r in rows if r["kind"] == "stopped"]
    assert stopped["stage"] == "train" and stopped["done"] == ["verifier"] and stopped["left_out"] == ["small-skewed"]
    assert main(["finetune", "--pairs", "self1", "--variants", "none,uniform_kd,scdf_kl", *common]) == 0
    rows = [r for r in load_rows(results) if r.get("experiment") == "languages"]
    assert {r["variant"] for r in rows if r["kind"] == "summary"} == {"none"}
    (stopped,) = [r for r in rows if r["kind"] == "stopped"]
    assert stopped["stage"] == "finetune"
    assert stopped["done"] == [["self1", "none"]]
    assert stopped["left_out"] == [["self1", "uniform_kd"], ["self1", "scdf_kl"]]
    assert stopped["elapsed_seconds"] > stopped["stage_max_seconds"]
    assert main(["report", "--results", str(results), "--no-plots"]) == 0
    report = (results / "report.md").read_text(encoding="utf-8")
    assert "## Stopped by a seconds cap" in report and "self1/uniform_kd, self1/scdf_kl" in report
    assert "| finetune / languages |" in report and "| train |" in report
