"""The multilingual experiment's pipeline (examples/multilingual/) end to end on a CPU, at tiny scale.

The test writes three languages of small data in the shared data's formats (mCoT JSON lines, NTREX-128 text files
with CRLF and DOCUMENT_IDS.tsv, GSM8K JSON lines, MGSM TSV), runs every stage with the smoke preset and checks what
they wrote: the corpus keeps the evaluation questions out, models are written in shards of at most the size asked for
and load back, the verifier is unchanged by every finetuning, the report has every variant and language, the rows
record their settings, and the per-character variant gets each language's characters per token. Under torchrun (two
processes, gloo) the finetuning stage gives the drafter of one process.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from multilingual import config as ml_config  # noqa: E402
from multilingual import corpus as ml_corpus  # noqa: E402
from multilingual.pipeline import main  # noqa: E402
from multilingual.report import load_rows, repeated_runs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LANGS = ("en", "de", "ru")
WORDS = {"en": "apple river stone house green small walks sees buys gives".split(),
         "de": "Apfel Fluss Stein Haus grün klein geht sieht kauft gibt".split(),
         "ru": "яблоко река камень дом зелёный малый идёт видит купит даёт".split()}
TRIGGERS = {"en": "Let's think step by step.", "de": "Denken wir Schritt für Schritt.",
            "ru": "Давайте думать поэтапно."}
NTREX_CODES = {"en": "src.eng", "de": "ref.deu", "ru": "ref.rus"}


def _sentence(rng: random.Random, lang: str) -> str:
    words = [rng.choice(WORDS[lang]) for _ in range(rng.randint(4, 9))]
    return " ".join(words).capitalize() + f" {rng.randint(2, 99)}."


def write_small_data(folder: Path, seed: int = 0) -> dict[str, list[str]]:
    """Small data in the shared folder's formats; returns the MGSM questions per language."""
    rng = random.Random(seed)
    mcot = folder / "mcot_msvamp" / "mcot_outputs"
    mcot.mkdir(parents=True)
    (folder / "mcot_msvamp" / "prompt.txt").write_text(
        "".join(f"{lang} || {TRIGGERS[lang]}\n" for lang in LANGS), encoding="utf-8")
    mgsm_questions = {lang: [_sentence(random.Random(100 + i), lang) + " ?" for i in range(4)] for lang in LANGS}
    for lang in ("en", "de"):  # ru, like te in the real data, has news only
        rows = []
        for i in range(24):
            question = _sentence(rng, lang) + " ?"
            if i == 0:  # an evaluation question in the training data: prepare must drop it
                question = mgsm_questions[lang][0]
            prompt = ml_corpus.cot_prompt(question, TRIGGERS[lang])
            response = " ".join(_sentence(rng, lang) for _ in range(3)) + f" {rng.randint(1, 9)}+{rng.randint(1, 9)}"
            rows.append({"question": prompt, "response": response, "prediction": "1", "answer": "1.0",
                         "result": True})
        (mcot / f"mcot_ft_msvamp_{lang}.json").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        # the MGSM outputs are evaluation material: prepare must never read them
        (mcot / f"mcot_ft_mgsm_{lang}.json").write_text(json.dumps({"question": "LEAK", "response": "LEAK"}) + "\n",
                                                        encoding="utf-8")
    ntrex = folder / "ntrex128"
    ntrex.mkdir()
    lines = 30
    (ntrex / "DOCUMENT_IDS.tsv").write_text("".join(f"doc.{i // 6}\n" for i in range(lines)), encoding="utf-8")
    for lang in LANGS:
        text = "".join(_sentence(rng, lang) + "\r\n" for _ in range(lines))
        (ntrex / f"newstest2019-{NTREX_CODES[lang]}.txt").write_bytes(text.encode("utf-8"))
    gsm = folder / "gsm8k"
    gsm.mkdir()
    (gsm / "train.jsonl").write_text("".join(json.dumps({
        "question": _sentence(rng, "en") + " ?", "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"}) + "\n"
        for i in range(10)), encoding="utf-8")
    mgsm = folder / "mgsm"
    mgsm.mkdir()
    for lang in LANGS:
        (mgsm / f"mgsm_{lang}.tsv").write_text(
            "".join(f"{q}\t{i + 3}\n" for i, q in enumerate(mgsm_questions[lang])), encoding="utf-8")
    return mgsm_questions


def smoke_settings(data: Path) -> list[str]:
    return ["--preset", "smoke", "--set", f"languages={json.dumps(list(LANGS))}", "--set",
            f"eval_data={data / 'mgsm'}", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, one_torch_thread):
    """One run of every stage: ``all`` with the smoke preset on the small data."""
    root = tmp_path_factory.mktemp("multilingual")
    data = root / "data"
    questions = write_small_data(data)
    work, results = root / "work", root / "results"
    assert main(["all", "--data", str(data), "--work", str(work), "--results", str(results),
                 *smoke_settings(data)]) == 0
    return {"data": data, "work": work, "results": results, "questions": questions}


def test_prepare_keeps_evaluation_text_out_and_balances_the_tokenizer(smoke_run):
    work = smoke_run["work"]
    with gzip.open(work / "corpus" / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
        train = [json.loads(line) for line in handle]
    with gzip.open(work / "corpus" / "heldout.jsonl.gz", "rt", encoding="utf-8") as handle:
        heldout = [json.loads(line) for line in handle]
    texts = [r["text"] for r in train + heldout]
    assert not any("LEAK" in t for t in texts), "mcot_ft_mgsm_* is evaluation material"
    for lang, questions in smoke_run["questions"].items():
        assert not any(q in t for q in questions for t in texts), f"an MGSM question of {lang} was kept"
    manifest = json.loads((work / "corpus" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["dropped_as_evaluation_questions"] == {"en": 1, "de": 1}
    assert {(r["lang"], r["domain"]) for r in train} == {("en", "cot"), ("de", "cot"), ("en", "news"),
                                                         ("de", "news"), ("ru", "news")}
    assert {(r["lang"], r["domain"]) for r in heldout} == {(r["lang"], r["domain"]) for r in train}
    assert not {r["text"] for r in train} & {r["text"] for r in heldout}
    gsm = [r["text"] for r in train + heldout if "The answer is" in r["text"]]
    assert gsm and not any("<<" in t or "####" in t for t in gsm)
    assert all("\r" not in t for t in texts)
    tokenizer = ml_corpus.load_tokenizer(work)
    assert [tokenizer.convert_tokens_to_ids(t) for t in ml_corpus.SPECIAL_TOKENS] == [0, 1, 2, 3]
    ids = tokenizer("Давайте 123", add_special_tokens=True)["input_ids"]
    assert ids[0] == ml_corpus.BOS_ID and tokenizer.decode(ids, skip_special_tokens=True) == "Давайте 123"
    assert tokenizer.unk_token_id not in ids
    cfg = ml_config.build_config(file=work / "config.json")
    assert cfg.preset == "smoke" and cfg.languages == list(LANGS)
    prepare = [r for r in load_rows(smoke_run["results"]) if r["kind"] == "prepare"]
    assert len(prepare) == 1 and prepare[0]["settings"] == cfg.to_dict()


def _model_name(path: Path) -> str:
    """The model a file of save_model belongs to (``<name>.safetensors`` or ``<name>-NN-of-MM.safetensors``)."""
    return re.sub(r"(-\d\d-of-\d\d)?\.safetensors$", "", path.name)


def test_models_load_back_and_the_rows_record_their_training(smoke_run):
    from multilingual.models import load_model

    work = smoke_run["work"]
    cfg = ml_config.build_config(file=work / "config.json")
    files = sorted((work / "models").glob("*.safetensors"))
    assert {_model_name(f) for f in files} == {"verifier", "small-skewed", "tiny-en"}
    verifier = load_model(work / "models", "verifier")
    drafter = load_model(work / "models", "tiny-en")
    assert verifier.config.model_type == "llama" and drafter.config.model_type == "qwen2"
    assert verifier.lm_head.weight.data_ptr() == verifier.model.embed_tokens.weight.data_ptr()
    train_rows = [r for r in load_rows(smoke_run["results"]) if r["kind"] == "train"]
    assert {r["model"] for r in train_rows} == {"verifier", "small-skewed", "tiny-en"}
    assert all(r["settings"] == cfg.to_dict() for r in train_rows)
    skewed = next(r for r in train_rows if r["model"] == "small-skewed")
    assert skewed["weights"]["ru"] == pytest.approx(0.05 / 2.05)
    assert set(skewed["heldout_loss"]) == set(LANGS)
    balanced = next(r for r in train_rows if r["model"] == "verifier")
    assert balanced["weights"] == pytest.approx({lang: 1 / len(LANGS) for lang in LANGS})
    assert balanced["params"] < sum(v.numel() for v in verifier.state_dict().values())  # the tied head counted once


def test_models_are_written_in_shards_of_at_most_max_file_mb(tmp_path):
    from multilingual.models import build_model, load_model, save_model

    spec = ml_config.build_config("smoke").verifier
    model = build_model(spec, 320, 160, seed=0)
    limit_mb = 0.1
    files = save_model(model, tmp_path, "sharded", max_file_mb=limit_mb)
    assert len(files) >= 2 and all(re.fullmatch(rf"sharded-\d\d-of-{len(files):02d}\.safetensors", f.name)
                                   for f in files)
    assert all(f.stat().st_size <= limit_mb * 1e6 for f in files)
    assert {_model_name(f) for f in files} == {"sharded"}
    loaded = load_model(tmp_path, "sharded")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    expected = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    files[1].unlink()
    with pytest.raises(ValueError, match=rf"model 'sharded' in .* has {len(files) - 1} of its {len(files)} files"):
        load_model(tmp_path, "sharded")


def test_a_configured_verifier_mix_is_trained_on(smoke_run, tmp_path):
    from multilingual import stages

    work = tmp_path / "work"
    shutil.copytree(smoke_run["work"], work, ignore=shutil.ignore_patterns("models", "results", "finetuned"))
    cfg = ml_config.build_config(file=work / "config.json", overrides={
        "verifier": {**ml_config.smoke_preset()["verifier"], "mix": {"ru": 3.0}, "steps": 1}})
    ctx = stages.Context(cfg=cfg, work=work, results=tmp_path / "results", device=torch.device("cpu"),
                         progress=False)
    (row,) = stages.stage_train(ctx, ["verifier"])
    assert row["weights"] == pytest.approx({"en": 0.2, "de": 0.2, "ru": 0.6})


def test_every_pair_variant_and_language_is_evaluated_with_the_verifier_unchanged(smoke_run):
    cfg = ml_config.build_config(file=smoke_run["work"] / "config.json")
    rows = load_rows(smoke_run["results"])
    summaries = [r for r in rows if r["kind"] == "summary" and r["experiment"] == "languages"]
    pairs = [d.name for d in cfg.drafters]
    assert "ngram" in pairs and cfg.drafter("ngram").kind == "ngram"
    expected = {(p, v) for p in pairs for v in (["none"] if p == "ngram" else cfg.variants)}
    assert {(r["pair"], r["variant"]) for r in summaries} == expected  # an n-gram drafter is not finetuned
    assert all(r["verifier_greedy_identical"] for r in summaries)
    assert len({r["verifier_weights_sha256"] for r in summaries}) == 1
    assert len({r["verifier_greedy_sha256"] for r in summaries}) == 1
    tasks = [r for r in rows if r["kind"] == "task" and r["experiment"] == "languages"]
    assert {r["task"] for r in tasks} == set(LANGS)
    for r in tasks:
        for key in ("alpha", "alpha_measured", "tokens_per_call", "chars_per_call", "speedup_predicted",
                    "speedup_measured", "cross_entropy", "kl", "tv", "fitness", "chars_per_token",
                    "char_speedup_predicted", "char_rate_generation", "char_rate_measured",
                    "speedup_measured_decode", "first_token_seconds"):
            assert r[key] is not None, key
        assert r["char_speedup_predicted"] == pytest.approx(r["chars_per_token"] * r["speedup_predicted"])
        assert r["char_rate_measured"] == pytest.approx(r["chars_per_token"] * r["speedup_measured"])
        assert r["kl_per_char"] == pytest.approx(r["kl"] / r["chars_per_token"])
        for key in ("settings", "train_chars_per_token", "finetune_initial", "finetune_final"):
            assert key not in r, key  # what holds for the whole run is on the summary row only
    for r in summaries:
        assert r["U_kl_per_char"] is not None and r["dominant_alpha"] is not None
        assert (r["finetune_steps"] == 0) == (r["variant"] == "none")
        assert r["per_character"] == ("_char" in r["variant"])
        assert r["mixture_weight"] == (None if r["variant"] == "none" else 0.5 if r["variant"].endswith("_mix50")
                                       else 0.0)
        assert r["settings"] == cfg.to_dict() and set(r["train_chars_per_token"]) == set(LANGS)
        assert ("finetune_final" in r) == (r["variant"] != "none")
        rates = {t["task"]: t["char_speedup_predicted"] for t in tasks
                 if (t["pair"], t["variant"]) == (r["pair"], r["variant"])}
        assert r["worst_char_rate_task"] == min(rates, key=rates.get)
        assert r["char_speedup_predicted_max_over_min"] == pytest.approx(max(rates.values()) / min(rates.values()))
        assert r["worst_task"] in LANGS and "worst_alpha_task" not in r
    none = {r["pair"]: r["drafter_weights_sha256"] for r in summaries if r["variant"] == "none"}
    tuned = [r for r in summaries if r["variant"] != "none"]
    assert all(r["drafter_weights_sha256"] != none[r["pair"]] for r in tuned), "every variant trains the drafter"
    domains = [r for r in rows if r["kind"] == "task" and r["experiment"] == "domains"]
    assert {r["task"] for r in domains} == {"en/cot", "en/news"}
    assert {r["variant"] for r in domains} == set(cfg.domain_variants)


def test_the_report_has_every_variant_and_language(smoke_run):
    cfg = ml_config.build_config(file=smoke_run["work"] / "config.json")
    report = (smoke_run["results"] / "report.md").read_text(encoding="utf-8")
    assert "Smoke preset" in report
    for pair in (d.name for d in cfg.drafters):
        section = report.split(f"### Pair: verifier + {pair}")[1].split("### Pair")[0]
        assert "Per token:" in section and "Per character" in section
        for variant in cfg.variants:
            assert (f"| {variant} |" in section) == (pair != "ngram" or variant == "none"), (pair, variant)
        header = next(line for line in section.splitlines() if line.startswith("| variant | en"))
        assert all(f" {lang} " in header for lang in LANGS)
    assert "Against uniform distillation" in report
    assert "S measured: over specdec.generate with no drafts (same path)." in report  # the default baseline
    assert "S measured after the first token (the rounds alone) per task:" in report
    figures = sorted(p.name for p in (smoke_run["results"] / "figures").glob("*.png"))
    assert "languages__small-skewed__alpha.png" in figures and \
        "domains__small-skewed__char_speedup_predicted.png" in figures
    fingerprinted = [r for r in load_rows(smoke_run["results"])
                     if r["kind"] == "summary" and r.get("verifier_greedy_identical") is not None]
    assert fingerprinted and all(r["verifier_greedy_identical"] is True for r in fingerprinted)
    assert "| yes |" in report and "| NO |" not in report  # the greedy-identical column


def test_repeated_runs_compare_the_latest_run_with_each_earlier_one():
    def run(time, variant, alphas, mean):
        meta = {"experiment": "languages", "pair": "p", "variant": variant, "world_size": 1, "time": time}
        return [{**meta, "kind": "task", "task": t, "alpha": a} for t, a in alphas.items()] + \
            [{**meta, "kind": "summary", "alpha_mean": mean, "alpha_std": 0.1, "alpha_measured_mean": None,
              "U_ce": 0.5}]

    rows = (run("t1", "a", {"x": 0.50, "y": 0.40}, 0.45) + run("t3", "a", {"x": 0.50, "y": 0.43}, 0.465)
            + run("t2", "a", {"x": 0.49, "y": 0.40}, 0.445) + run("t1", "b", {"x": 0.3, "y": 0.3}, 0.3))
    (row,) = repeated_runs(rows)
    # latest (t3) against t1 and t2: two comparisons; variant b ran once; no generation figure: nan
    assert row[:4] == ["languages", "p", 1, 2]
    assert row[4] == pytest.approx(0.03) and row[5] == pytest.approx(0.02) and row[6] == 0 and row[8] == 0
    assert math.isnan(row[7])


def test_per_character_variant_uses_the_training_rho(smoke_run, monkeypatch):
    """The finetuning stage hands finetune_drafter each language's characters per token on its training texts
    (``<bos>`` and ``<eos>`` counted, as finetune_drafter counts them), and the variant's config is per character."""
    from multilingual import stages

    import specdec

    seen = []
    original = specdec.finetune_drafter

    def recording(*args, **kwargs):
        kwargs["callback"] = lambda step, info: seen.append(info)
        result = original(*args, **kwargs)
        seen.append({"rho": kwargs["chars_per_token"], "config": result.config})
        return result

    monkeypatch.setattr(specdec, "finetune_drafter", recording)
    work, results = smoke_run["work"], smoke_run["results"].parent / "results-char"
    cfg = ml_config.build_config(file=work / "config.json")
    ctx = stages.Context(cfg=cfg, work=work, results=results, device=torch.device("cpu"), progress=False)
    stages.stage_finetune(ctx, ["small-skewed"], ["scdf_char_kl"])
    *steps, final = seen
    stats = json.loads((work / "corpus" / "manifest.json").read_text(encoding="utf-8"))["stats"]["train"]
    for lang in LANGS:  # the manifest counts tokens without <bos> and <eos>, as rho does
        chars = sum(st["chars"] for st in stats[lang].values())
        tokens = sum(st["tokens"] for st in stats[lang].values())
        assert final["rho"][lang] == pytest.approx(chars / tokens)
    assert final["config"].per_character and final["config"].weight_basis == "kl"
    assert len(steps) == cfg.finetune_steps
    for info in steps:
        assert info["chars_per_token"] == pytest.approx([final["rho"][lang] for lang in LANGS])
    summary = next(r for r in load_rows(results) if r["kind"] == "summary")
    assert summary["train_chars_per_token"] == pytest.approx(final["rho"])


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"wall_clock_baseline must be one of \('hf', 'specdec'\), got 'eager'"):
        ml_config.build_config("smoke", overrides={"wall_clock_baseline": "eager"})
    with pytest.raises(ValueError, match="unknown variant 'scdf_js'"):
        ml_config.build_config("smoke", overrides={"variants": ["none", "scdf_js"]})
    with pytest.raises(ValueError, match="variant 'uniform_kd_char': per_character=True reweights the tasks of method "
                                         "'scdf' or 'exact_variance'"):
        ml_config.build_config("smoke", overrides={"variants": ["none", "uniform_kd_char"]})
    with pytest.raises(ValueError, match=r"variants: variant 'uniform_kd': lr must be a finite number > 0.* "
                                         r"\(setting finetune_lr\)"):
        ml_config.build_config("smoke", overrides={"finetune_lr": 0})
    with pytest.raises(ValueError, match=r"domain_variants: variant 'uniform_kd': weight_floor must be .*>= 0.* "
                                         r"\(setting weight_floor\)"):
        ml_config.build_config("smoke", overrides={"weight_floor": -0.5, "variants": ["none"]})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['finetune_stepz'\]"):
        ml_config.build_config("smoke", overrides={"finetune_stepz": 3})
    with pytest.raises(ValueError, match="dominant_language 'xx'"):
        ml_config.build_config("smoke", overrides={"dominant_language": "xx"})
    with pytest.raises(ValueError, match=r"drafters\[2\].self_layers must be below the verifier's 2 layers"):
        cfg = ml_config.smoke_preset()
        cfg["drafters"][2]["self_layers"] = 2
        ml_config.build_config("full", overrides=cfg)
    with pytest.raises(ValueError, match=r"drafters\[0\].mix\['ru'\] must be a finite number >= 0"):
        cfg = ml_config.smoke_preset()
        cfg["drafters"][0]["mix"] = {"ru": -1}
        ml_config.build_config("full", overrides=cfg)
    with pytest.raises(ValueError, match="--set takes key=value"):
        ml_config.parse_overrides(["finetune_steps"])
    with pytest.raises(SystemExit):
        main(["prepare", "--work", "/nonexistent"])  # prepare needs --data
    with pytest.raises(FileNotFoundError, match="run the prepare stage first"):
        main(["train", "--work", "/nonexistent/work", "--no-progress"])


def test_variant_names_set_the_finetuning_fields():
    assert ml_config.parse_variant("none") is None
    assert ml_config.parse_variant("scdf_kl") == {"method": "scdf", "weight_basis": "kl", "per_character": False}
    assert ml_config.parse_variant("scdf_char_kl_mix50") == {
        "method": "scdf", "weight_basis": "kl", "per_character": True, "mixture_weight": 0.5,
        "normalize_weights": True}
    assert ml_config.parse_variant("exact_variance_mix25") == {
        "method": "exact_variance", "weight_basis": "ce", "per_character": False, "mixture_weight": 0.25,
        "normalize_weights": True}
    assert ml_config.parse_variant("scdf_mix0")["mixture_weight"] == 0.0
    assert ml_config.parse_variant("scdf_tv_mix100")["mixture_weight"] == 1.0
    cfg = ml_config.build_config("smoke")
    config = ml_config.finetune_config(cfg, "scdf_char_kl_mix50")
    assert (config.mixture_weight, config.normalize_weights, config.per_character) == (0.5, True, True)
    full = ml_config.build_config("full").variants
    assert full[-2:] == ["scdf_kl_mix50", "scdf_char_kl_mix50"] and "scdf_char_kl_mix50" in cfg.variants
    for bad in ("scdf_mix101", "scdf_mix05", "scdf_mix", "scdf_mix50_kl", "scdf_mix-5", "scdf_mix0.5"):
        with pytest.raises(ValueError, match=rf"unknown variant '{re.escape(bad)}'.*_mix<P>"):
            ml_config.parse_variant(bad)
    from multilingual.report import _order

    assert _order(["scdf_char_kl_mix50", "scdf_kl_mix50", "scdf_char_kl", "scdf_kl", "uniform_kd", "none"]) == [
        "none", "uniform_kd", "scdf_kl", "scdf_kl_mix50", "scdf_char_kl", "scdf_char_kl_mix50"]
    with pytest.raises(ValueError, match="variant 'uniform_kd_mix50': mixture_weight=0.5 mixes uniform distillation "
                                         "into the corrective loss"):
        ml_config.build_config("smoke", overrides={"variants": ["none", "uniform_kd_mix50"]})


def test_bad_finetuning_settings_stop_a_run_before_any_stage(smoke_run, tmp_path):
    """A finetuning setting FinetuneConfig refuses stops the run when the settings are read, before any training."""
    results = tmp_path / "results"
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0.* \(setting finetune_lr\)"):
        main(["all", "--data", str(smoke_run["data"]), "--work", str(tmp_path / "work"), "--results", str(results),
              *smoke_settings(smoke_run["data"]), "--set", "finetune_lr=-1"])
    with pytest.raises(ValueError, match=r"weight_floor must be .*>= 0.* \(setting weight_floor\)"):
        main(["finetune", "--work", str(smoke_run["work"]), "--results", str(results), "--no-progress",
              "--device", "cpu", "--set", "weight_floor=-1"])
    assert not (tmp_path / "work").exists() and not results.exists()


def test_torchrun_two_processes_match_one_process(smoke_run, tmp_path):
    """The finetuning stage under torchrun (2 processes, gloo, the same global batch) gives the drafter that one
    process gives, within float32 noise."""
    work = tmp_path / "work"
    shutil.copytree(smoke_run["work"], work, ignore=shutil.ignore_patterns("results", "finetuned"))
    results = tmp_path / "results"
    common = ["finetune", "--work", str(work), "--results", str(results), "--pairs", "small-skewed", "--variants",
              "scdf_kl", "--save-drafters", "--device", "cpu", "--no-progress", "--set", "finetune_steps=3",
              "--set", "wall_clock=false"]
    script = str(ROOT / "examples" / "multilingual" / "run.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    one = subprocess.run([sys.executable, script, *common], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = subprocess.run([*torchrun, script, *common], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main(["ddp-compare", "--work", str(work), "--results", str(results), "--no-progress"]) == 0
    ddp = [r for r in load_rows(results) if r["kind"] == "ddp"]
    assert len(ddp) == 1 and ddp[0]["world_size"] == 2
    assert ddp[0]["settings"] == ml_config.build_config(file=work / "config.json").to_dict()
    assert ddp[0]["max_abs_weight_difference"] < 1e-4 and ddp[0]["relative_l2_weight_difference"] < 1e-5
    summaries = {r["world_size"]: r for r in load_rows(results) if r["kind"] == "summary"}
    assert set(summaries) == {1, 2}
    assert all(r["settings"]["finetune_steps"] == 3 and not r["settings"]["wall_clock"] for r in summaries.values())
    assert summaries[2]["alpha_mean"] == pytest.approx(summaries[1]["alpha_mean"], abs=1e-4)
    assert main(["report", "--results", str(results), "--no-plots"]) == 0
    assert "One process against DDP" in (results / "report.md").read_text(encoding="utf-8")


def test_a_verifier_changed_by_finetuning_stops_the_run(smoke_run, monkeypatch, tmp_path):
    from multilingual import stages

    import specdec

    original = specdec.finetune_drafter

    def tampering(drafter, verifier, *args, **kwargs):
        result = original(drafter, verifier, *args, **kwargs)
        with torch.no_grad():
            next(verifier.parameters()).add_(1e-3)
        return result

    monkeypatch.setattr(specdec, "finetune_drafter", tampering)
    cfg = ml_config.build_config(file=smoke_run["work"] / "config.json")
    ctx = stages.Context(cfg=cfg, work=smoke_run["work"], results=tmp_path, device=torch.device("cpu"),
                         progress=False)
    with pytest.raises(RuntimeError, match="the verifier's weights changed while finetuning tiny-en with balanced"):
        stages.stage_finetune(ctx, ["tiny-en"], ["none", "balanced"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (static generate path, bf16 models)")
def test_on_a_gpu_the_pair_runs_in_bf16_on_the_static_path(smoke_run, tmp_path):
    results = tmp_path / "results"
    assert main(["finetune", "--work", str(smoke_run["work"]), "--results", str(results), "--pairs", "self1",
                 "--variants", "none,scdf_char_kl", "--device", "cuda", "--no-progress"]) == 0
    summaries = [r for r in load_rows(results) if r["kind"] == "summary"]
    assert len(summaries) == 2 and all(r["device"] != "cpu" and r["verifier_greedy_identical"] for r in summaries)
    assert all(r["cost_ratio_path"] == "static" for r in summaries)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (torchrun with NCCL)")
def test_on_two_gpus_torchrun_matches_one_gpu(smoke_run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(smoke_run["work"], work, ignore=shutil.ignore_patterns("results", "finetuned"))
    results = tmp_path / "results"
    common = ["finetune", "--work", str(work), "--results", str(results), "--pairs", "small-skewed", "--variants",
              "scdf_kl", "--save-drafters", "--device", "cuda", "--no-progress", "--set", "wall_clock=false"]
    script = str(ROOT / "examples" / "multilingual" / "run.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0"}
    one = subprocess.run([sys.executable, script, *common], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    env.pop("CUDA_VISIBLE_DEVICES")
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          script, *common], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main(["ddp-compare", "--work", str(work), "--results", str(results), "--no-progress"]) == 0
    ddp = next(r for r in load_rows(results) if r["kind"] == "ddp")
    assert ddp["relative_l2_weight_difference"] < 1e-2  # bf16 autocast: the two reductions round differently
