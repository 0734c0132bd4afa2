"""The offline demo in quick mode: where it writes, its cache, and its refusal to write into the source tree."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from specdec.cli import demo, demo_pair
from specdec.cli.demo_report import comparison_markdown
from specdec.fairness.report import cost_ratio_line

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_ARTIFACTS = ("report.md", "report.json", "speedup_by_task.png", "fairness_before.png", "fairness_after_scdf.png",
                  "pair.json")


def demo_artifacts_in_repo() -> set[Path]:
    """Files under the checkout that look like demo output (the virtual environment and .git are skipped)."""
    found = set()
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [name for name in subfolders if name not in (".git", ".venv", "venv", "__pycache__")]
        found.update(Path(folder) / name for name in files if name in DEMO_ARTIFACTS)
        found.update(Path(folder) / name for name in subfolders if name.startswith("demo-pair-"))
    return found


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    before = demo_artifacts_in_repo()
    result = demo.run_demo(root / "report", cache_dir=root / "cache", quick=True, progress=False, echo=None)
    assert demo_artifacts_in_repo() == before, "the demo wrote into the source tree"
    return root, result


def test_report_and_plots_are_written_where_asked(first_run):
    root, result = first_run
    assert result.output_dir == (root / "report").resolve()
    assert result.report_path == result.output_dir / "report.md"
    text = result.report_path.read_text(encoding="utf-8")
    assert "# specdec demo report" in text and "## Fairness: s-CDF drafter" in text
    assert (result.output_dir / "report.json").is_file()
    assert len(result.plot_paths) == 3
    for path in result.plot_paths:
        assert path.parent == result.output_dir
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [row["drafter"] for row in result.comparison] == ["original", "s-CDF"]
    # c was not given: measured once on this machine, and said so everywhere (text, JSON, every report)
    assert result.cost_ratio.source == "measured"
    assert f"cost ratio {cost_ratio_line(result.cost_ratio.summary(), short=True)}" in text
    assert cost_ratio_line(result.cost_ratio.summary()) in text  # with its path, batch, repetitions and spread
    assert "(given)" not in text and "--cost-ratio" not in text
    saved = json.loads((result.output_dir / "report.json").read_text(encoding="utf-8"))
    assert saved["cost_ratio_source"] == "measured" and saved["cost_ratio"] == result.cost_ratio.value
    for report in saved["reports"].values():
        assert report["summary"]["cost_ratio_source"] == "measured"
        assert report["summary"]["cost_ratio"] == saved["cost_ratio"]
    # the wall clock is measured per task beside the prediction, in the tables, the JSON and the comparison
    assert all(row.speedup_measured is not None and row.speedup_predicted is not None for row in result.before.tasks)
    assert "S measured" in text and "S predicted" in text and '"S measured" is the generation rate' in text
    assert saved["reports"]["original"]["tasks"][0]["speedup_measured"] is not None
    assert all(row["speedup_measured_min"] is not None for row in result.comparison)
    assert set(result.samples) == set(demo.data.TASK_NAMES)
    assert {row.name for row in result.before.tasks} == set(demo.data.TASK_NAMES)


def test_second_run_reuses_the_cached_pair(first_run, monkeypatch):
    root, result = first_run
    assert not result.cache_hit
    assert (result.pair_dir / demo.PAIR_META_NAME).is_file()
    assert result.pair_dir.parent == (root / "cache").resolve()

    def no_training(*args, **kwargs):
        raise AssertionError("the cached pair was retrained")

    monkeypatch.setattr(demo_pair, "train_language_model", no_training)
    again = demo.run_demo(root / "report-2", cache_dir=root / "cache", quick=True, progress=False, echo=None,
                          baselines=True, cost_ratio=0.05, wall_clock=False)
    assert again.cache_hit and again.pair_dir == result.pair_dir
    assert [row["drafter"] for row in again.comparison] == ["original", "s-CDF", *demo.BASELINE_METHODS]
    assert again.pair_info["cache_key"] == result.pair_info["cache_key"]
    # Same pair, same seed: the measured figures are reproduced.
    assert again.before.summary["U_ce"] == pytest.approx(result.before.summary["U_ce"], rel=1e-6)
    text = again.report_path.read_text(encoding="utf-8")
    assert "c = 0.05 (given)" in text and "--cost-ratio" in text and "(measured" not in text
    saved = json.loads((again.output_dir / "report.json").read_text(encoding="utf-8"))
    assert saved["cost_ratio_source"] == "given" and saved["cost_ratio"] == 0.05
    assert all(report["summary"]["cost_ratio_source"] == "given" for report in saved["reports"].values())
    # without the wall clock nothing claims to be measured speed
    assert all(row.speedup_measured is None for row in again.before.tasks)
    assert "S measured" not in text and "not measured (--no-wall-clock)" in text


def test_an_unusable_output_dir_is_refused_before_any_work(tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the demo started working before checking --output-dir")

    monkeypatch.setattr(demo, "get_demo_pair", no_work)
    a_file = tmp_path / "a-file"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(demo.DemoError, match="--output-dir .* exists and is not a folder"):
        demo.run_demo(a_file, cache_dir=tmp_path / "cache", quick=True, progress=False, echo=None)
    with pytest.raises(demo.DemoError, match="--output-dir cannot create or write .*a-file.below"):
        demo.run_demo(a_file / "below", cache_dir=tmp_path / "cache", quick=True, progress=False, echo=None)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"cost_ratio": -1.0}, "cost_ratio must be a finite number >= 0"),
    ({"cost_ratio": float("nan")}, "cost_ratio must be a finite number >= 0"),
    ({"cost_ratio": "0.1"}, "cost_ratio must be a float"),
    ({"cost_ratio": True}, "cost_ratio must be a float"),
    ({"wall_clock": "yes"}, "wall_clock must be True or False"),
    ({"finetune_steps": 0}, "finetune_steps must be >= 1"),
])
def test_bad_settings_are_refused_before_any_work(tmp_path, monkeypatch, kwargs, needle):
    def no_work(*args, **kwargs):
        raise AssertionError("the demo started working before checking its settings")

    monkeypatch.setattr(demo, "get_demo_pair", no_work)
    with pytest.raises(demo.DemoError, match=needle):
        demo.run_demo(tmp_path / "report", cache_dir=tmp_path / "cache", quick=True, progress=False, echo=None,
                      **kwargs)


def test_comparison_table_pairs_each_header_with_its_figure():
    row = {"drafter": "original", "U_ce": 0.125, "U_kl": 0.25, "alpha_mean": 0.5, "alpha_min": 0.375,
           "worst_task": "reverse", "speedup_predicted_min": 1.125, "speedup_predicted_max": 2.5,
           "speedup_predicted_max_over_min": 2.25, "speedup_measured_min": 0.75, "speedup_measured_max": 1.75,
           "tokens_per_call_max_over_min": 1.5}
    header, _, cells = (line.strip("|").split("|") for line in comparison_markdown([row]).splitlines())
    table = dict(zip((h.strip() for h in header), (c.strip() for c in cells), strict=True))
    assert table == {"drafter": "original", "U (CE)": "0.125", "U (KL)": "0.25", "mean α": "0.5", "worst α": "0.375",
                     "worst task": "reverse", "S predicted min": "1.125", "S predicted max": "2.5",
                     "S predicted max/min": "2.25", "S measured min": "0.75", "S measured max": "1.75",
                     "tok/call max/min": "1.5"}
    # nothing measured on the wall clock: its columns are left out, the others keep their figures
    unmeasured = {**row, "speedup_measured_min": None, "speedup_measured_max": None}
    header, _, cells = (line.strip("|").split("|") for line in comparison_markdown([unmeasured]).splitlines())
    table = dict(zip((h.strip() for h in header), (c.strip() for c in cells), strict=True))
    assert "S measured min" not in table and "S measured max" not in table
    assert table["S predicted max/min"] == "2.25" and table["tok/call max/min"] == "1.5"


@pytest.mark.parametrize("damage", ["missing_drafter", "truncated_weights", "incomplete_meta"])
def test_damaged_cache_entry_is_retrained(first_run, tmp_path, damage):
    _, result = first_run
    cache = tmp_path / "cache"
    copied = cache / result.pair_dir.name
    shutil.copytree(result.pair_dir, copied)
    if damage == "missing_drafter":
        shutil.rmtree(copied / "drafter")
    elif damage == "truncated_weights":
        weights = copied / "drafter" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        meta = json.loads((copied / demo.PAIR_META_NAME).read_text(encoding="utf-8"))
        del meta["verifier_parameters"]
        (copied / demo.PAIR_META_NAME).write_text(json.dumps(meta), encoding="utf-8")
    pair = demo.get_demo_pair(cache, config=demo.default_pair_config(quick=True), progress=False)
    assert not pair.cache_hit and (copied / "drafter" / "model.safetensors").stat().st_size > 1000
    assert demo.load_pair(copied).cache_hit  # the rebuilt entry reads back


def test_source_tree_is_protected(tmp_path, monkeypatch):
    for inside in (REPO_ROOT / "specdec" / "demo-out", REPO_ROOT / "demo-out"):
        with pytest.raises(demo.DemoError, match="source tree"):
            demo.run_demo(inside, cache_dir=tmp_path, quick=True, progress=False, echo=None)
        assert not inside.exists()
    with pytest.raises(demo.DemoError, match="cache"):
        demo.get_demo_pair(REPO_ROOT / "cache-here", config=demo.default_pair_config(quick=True), progress=False)
    # The default folder, asked for from inside the checkout, is moved to the cache folder.
    monkeypatch.chdir(REPO_ROOT)
    target, note = demo.resolve_output_dir(None, tmp_path)
    assert target == (tmp_path / demo.DEFAULT_OUTPUT_DIR).resolve() and "source tree" in note
    monkeypatch.chdir(tmp_path)
    target, note = demo.resolve_output_dir(None, tmp_path / "cache")
    assert target == (tmp_path / demo.DEFAULT_OUTPUT_DIR).resolve() and note is None


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert demo.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECDEC_CACHE")
    assert demo.default_cache_dir() == tmp_path / "b" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.default_cache_dir() == tmp_path / "home" / ".cache" / "specdec"


def test_cache_key_tracks_the_configuration():
    full, quick = demo.default_pair_config(), demo.default_pair_config(quick=True)
    assert full.cache_key() == demo.default_pair_config().cache_key()
    assert len({full.cache_key(), quick.cache_key(), demo.default_pair_config(seed=1).cache_key()}) == 3


def test_full_demo_skews_the_drafter_mixture():
    config = demo.default_pair_config()
    drafter_mixture, verifier_mixture = dict(config.drafter_training.mixture), dict(config.verifier_training.mixture)
    assert set(drafter_mixture) == set(verifier_mixture) == set(demo.data.TASK_NAMES)
    assert max(verifier_mixture.values()) == pytest.approx(min(verifier_mixture.values()))
    assert min(drafter_mixture.values()) < 0.1 * max(drafter_mixture.values())
    assert config.drafter.hidden_size < config.verifier.hidden_size
