"""The ``specdec`` command line: every subcommand on small inputs, bad paths and bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import data
from specdec.cli import main

from models import perturbed_copy, tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny random verifier (with the tokenizer) and a perturbed drafter, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0)
    drafter = perturbed_copy(verifier, noise=0.5, seed=1)
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    drafter.save_pretrained(root / "drafter")
    return str(root / "verifier"), str(root / "drafter")


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    suite = data.synthetic_task_suite(3, seed=0, tasks=["count", "copy"])
    rows = [{"task": task, "prompt": ex.prompt, "text": ex.text} for task, examples in suite.items()
            for ex in examples]
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def odd_pairs(tmp_path_factory, pair_dirs) -> dict[str, str]:
    """Folders of models that do not fit the verifier of ``pair_dirs`` (or each other) in one way each."""
    root = tmp_path_factory.mktemp("odd")
    tokenizer = data.build_char_tokenizer()
    rows = tiny_llama(vocab_size=200, hidden_size=32, num_layers=1, seed=2)  # 200 output rows for 78 tokens
    rows.save_pretrained(root / "rows200")
    rows.save_pretrained(root / "rows200-same-tokenizer")
    tokenizer.save_pretrained(root / "rows200-same-tokenizer")
    other = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=3)
    other.save_pretrained(root / "other-tokenizer")  # the same size, the same characters under other ids
    data.build_char_tokenizer(data.ALPHABET[::-1]).save_pretrained(root / "other-tokenizer")
    for name, seed in (("short-verifier", 0), ("short-drafter", 1)):  # 64 positions
        model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=seed)
        model.config.max_position_embeddings = 64
        model.save_pretrained(root / name)
    tokenizer.save_pretrained(root / "short-verifier")
    return {path.name: str(path) for path in root.iterdir()}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _greedy_completion(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """The saved model's own greedy continuation of ``prompt`` (transformers' generate), decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------------- top level
def test_help_lists_every_subcommand(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("generate", "evaluate", "finetune", "bench", "demo", "exit codes"):
        assert command in out
    for command in ("generate", "evaluate", "finetune", "bench", "demo"):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0 and "usage: specdec " + command in out


def _subparsers() -> dict:
    import argparse

    from specdec.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_shows_its_default():
    import argparse

    for command, subparser in _subparsers().items():
        for action in subparser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"specdec {command} {name} has no help text"
            shown = action.default not in (None, False, argparse.SUPPRESS) and not action.required
            if shown and not isinstance(action, argparse._StoreConstAction):
                assert "default" in action.help, f"specdec {command} {name} does not show its default"
                if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                    assert f"default: {action.default:g}" in action.help or f"default: {action.default}" in \
                        action.help, f"specdec {command} {name}: the help shows another default"


def test_max_new_tokens_shows_each_commands_default(capsys):
    for command, default in (("generate", 64), ("evaluate", 32)):
        action = next(a for a in _subparsers()[command]._actions if a.dest == "max_new_tokens")
        assert action.default == default and f"(default: {default})" in action.help


def test_the_cli_uses_only_public_names_of_its_loading_module():
    import specdec.cli as cli
    import specdec.cli.loading as loading

    borrowed = [name for name, value in vars(cli).items()
                if getattr(value, "__module__", None) == loading.__name__ and name in vars(loading)]
    assert {"load_pair", "load_task_source", "check_output_folder", "UsageError"} <= set(borrowed)
    assert all(not name.startswith("_") for name in borrowed), borrowed


def test_commands_that_read_inputs_offer_no_progress_and_no_special_tokens():
    commands = _subparsers()
    for command in ("generate", "evaluate", "finetune"):
        assert {"--no-progress", "--no-special-tokens"} <= set(commands[command]._option_string_actions), command
    assert "--no-progress" in commands["demo"]._option_string_actions


def test_no_command_and_unknown_command_are_usage_errors(capsys):
    assert run_cli(capsys)[0] == 2
    code, _, err = run_cli(capsys, "translate")
    assert code == 2 and "invalid choice" in err


def test_python_dash_m_and_no_traceback(tmp_path):
    env = {**os.environ, "SPECDEC_DEBUG": ""}
    ok = subprocess.run([sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "specdec" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "specdec", "evaluate", "--verifier", "v", "--drafter", "d", "--tasks",
                          str(tmp_path / "missing.jsonl")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "no such file or folder" in bad.stderr and "Traceback" not in bad.stderr


# -------------------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("draft_options", [["-k", "2"], ["-k", "0"], ["-k", "auto", "--no-static"]])
def test_generate_prompts_greedy_matches_the_verifier(capsys, pair_dirs, draft_options):
    verifier_dir, drafter_dir = pair_dirs
    code, out, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--prompt",
                             "count 3:", "--prompt", "copy abc|", *draft_options, "--max-new-tokens", "6", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["count 3:", "copy abc|"]
    assert "tokens per verifier call" in err
    assert records[0]["completion"] == _greedy_completion(verifier_dir, "count 3:", 6)


def test_generate_prompts_file_and_sampling_options(capsys, pair_dirs, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the fox\n1+2=3;\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", drafter_dir,
                             "--prompts-file", str(prompts), "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                             "--seed", "3", "--max-new-tokens", "4", "--batch-size", "1", "--dtype", "float32",
                             "--verification", "block")
    assert code == 0, err
    assert "### prompt 1: 'the fox'" in out and "### prompt 2" in out and "2 prompt(s)" in out
    assert "specdec generate: 100%" in err and "2/2" in err, "a progress bar over the prompts"


@pytest.mark.parametrize("options, message", [
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["-k", "-1"], "-k/--num-draft-tokens"),
    (["-k", "many"], "-k/--num-draft-tokens"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--dtype", "float8"], "--dtype"),
    (["--temperature", "1e-7"], "--temperature"),
    (["--seed", "-1"], "--seed"),
    (["--eos-token-id", "-5"], "--eos-token-id"),
    (["--verification", "joint"], "--verification"),
])
def test_generate_bad_options(capsys, pair_dirs, options, message):
    verifier_dir, drafter_dir = pair_dirs
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--prompt", "a",
                           *options)
    assert code == 2 and message in err and "Traceback" not in err


def test_generate_bad_paths(capsys, pair_dirs, tmp_path):
    verifier_dir, _ = pair_dirs
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", str(tmp_path / "nope"),
                           "--prompt", "a")
    assert code == 2 and "--drafter" in err and "nope" in err
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", verifier_dir,
                           "--prompts-file", str(tmp_path / "absent.txt"))
    assert code == 2 and "absent.txt" in err
    code, _, err = run_cli(capsys, "generate", "--verifier", "nobody/no-such-model", "--drafter", verifier_dir,
                           "--prompt", "a")
    assert code == 1 and "offline" in err and "Traceback" not in err
    for option in ("--verifier", "--drafter", "--tokenizer"):  # checked before anything is loaded
        paths = {"--verifier": verifier_dir, "--drafter": verifier_dir, option: str(tmp_path / "missing")}
        code, _, err = run_cli(capsys, "generate", *[x for kv in paths.items() for x in kv], "--prompt", "a")
        assert code == 2 and f"argument {option}: no such folder" in err, err
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", verifier_dir,
                           "--prompts-file", str(tmp_path))
    assert code == 2 and "not a file" in err
    empty = tmp_path / "empty.jsonl"  # a file's problem is named with its line, not blamed on --prompt
    empty.write_text('{"prompt": "a"}\n{"prompt": ""}\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", verifier_dir,
                           "--prompts-file", str(empty))
    assert code == 1 and "empty.jsonl:2" in err and "--prompt:" not in err


def test_generate_refuses_an_eos_id_outside_the_vocabulary(capsys, pair_dirs):
    verifier_dir, drafter_dir = pair_dirs
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--prompt", "a",
                           "--eos-token-id", "100000", "--max-new-tokens", "2")
    assert code == 2 and "argument --eos-token-id" in err and "Traceback" not in err


# -------------------------------------------------------------------------------------------------------- evaluate
def test_evaluate_writes_the_report(capsys, pair_dirs, tasks_file, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    out_dir = tmp_path / "report"
    code, out, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--max-new-tokens", "4", "--cost-ratio", "0.5", "--no-progress",
                             "--output-dir", str(out_dir))
    assert code == 0, err
    assert "| count |" in out and "| copy |" in out and "U_ce" in out
    for name in ("report.md", "report.json", "report.png"):
        assert (out_dir / name).stat().st_size > 0
    report = json.loads((out_dir / "report.json").read_text())
    assert {row["name"] for row in report["tasks"]} == {"count", "copy"}
    assert all(row["speedup_measured"] > 0 for row in report["tasks"]), "the wall clock is measured by default"
    assert report["summary"]["wall_clock_baseline"] == "hf"
    code, out, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--max-new-tokens", "4", "--cost-ratio", "0.5", "--no-progress",
                             "--wall-clock-baseline", "specdec", "--wall-clock-repeats", "1",
                             "--output-dir", str(tmp_path / "same_path"))
    assert code == 0, err
    same_path = json.loads((tmp_path / "same_path" / "report.json").read_text())
    assert same_path["summary"]["wall_clock_baseline"] == "specdec"
    assert all(row["speedup_measured"] > 0 for row in same_path["tasks"])
    code, out, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--max-new-tokens", "4", "--cost-ratio", "0.5", "--no-progress",
                             "--no-wall-clock", "--output-dir", str(tmp_path / "fast"))
    assert code == 0, err
    fast = json.loads((tmp_path / "fast" / "report.json").read_text())
    assert all(row["speedup_measured"] is None for row in fast["tasks"])


def test_evaluate_tsv_and_mgsm_folder(capsys, pair_dirs, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    folder = tmp_path / "mgsm"
    folder.mkdir()
    (folder / "mgsm_la.tsv").write_text("the fox sees a cat.\tyes\ncount 4:\t5\n", encoding="utf-8")
    (folder / "mgsm_cy.tsv").write_text("тхе фож.\tда\n", encoding="utf-8")
    common = ["--verifier", verifier_dir, "--drafter", drafter_dir, "--max-new-tokens", "3", "--cost-ratio", "0.5",
              "--no-progress"]
    code, out, err = run_cli(capsys, "evaluate", "--tasks", str(folder), *common)
    assert code == 0, err
    assert "| la |" in out and "| cy |" in out
    tsv = tmp_path / "mixed.tsv"
    tsv.write_text("task\ttext\na\tcount 1: 2 3\nb\tcopy ab|ab.\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "evaluate", "--tasks", str(tsv), *common)
    assert code == 0, err
    assert "| a |" in out and "| b |" in out


def test_evaluate_builtin_mgsm_names_the_tasks_the_tokenizer_does_not_cover(capsys, pair_dirs):
    verifier_dir, drafter_dir = pair_dirs
    code, out, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             "mgsm", "--task-names", "en,bn", "--max-examples", "3", "--max-new-tokens", "2",
                             "--cost-ratio", "0.5", "--no-progress")
    assert code == 0, err
    assert "| en |" in out and "| bn |" in out and "| de |" not in out
    warnings = [line for line in err.splitlines() if line.startswith("specdec evaluate: warning: ")]
    assert len(warnings) == 1 and "task 'bn': " in warnings[0] and "'<unk>'" in warnings[0]
    rate = float(warnings[0].split("task 'bn': ")[1].split("%")[0])
    assert 70 < rate < 90  # the demo's character tokenizer has no Bengali letters
    code, _, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                           "mgsm", "--task-names", "en,xx")
    assert code == 2 and "argument --task-names: mgsm: no task named 'xx'; the tasks are bn, de, en" in err
    code, _, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                           "mgsm8k")
    assert code == 2 and "no such file or folder: mgsm8k (built-in data sets: mgsm)" in err


def test_evaluate_warns_about_texts_cut_at_the_positions(capsys, odd_pairs, tmp_path):
    tasks = tmp_path / "lengths.jsonl"
    rows = [{"task": "long", "text": "a" * 100}, {"task": "long", "text": "b" * 10},
            {"task": "fits", "text": "count 1: 2 3"}]
    tasks.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    common = ["--verifier", odd_pairs["short-verifier"], "--drafter", odd_pairs["short-drafter"], "--tasks",
              str(tasks), "--max-new-tokens", "2", "--cost-ratio", "0.5", "--no-progress"]
    code, out, err = run_cli(capsys, "evaluate", *common)
    assert code == 0, err
    # with BOS the long text has 101 tokens; the models have 64 positions
    assert err.count("warning:") == 1 and ("warning: task 'long': 1 of its 2 texts are longer than the models' 64 "
                                           "positions (max_position_embeddings): 37 of their 112 tokens (33%) are "
                                           "cut off and not measured") in err
    code, out, err = run_cli(capsys, "evaluate", *common, "--max-length", "8")
    assert code == 0 and "task 'long': 2 of its 2 texts are longer than max_length=8" in err
    assert "task 'fits': 1 of its 1 texts are longer than max_length=8" in err


def test_a_drafter_with_more_output_rows_needs_vocab_size(capsys, pair_dirs, odd_pairs):
    verifier_dir, _ = pair_dirs
    common = ["generate", "--verifier", verifier_dir, "--prompt", "count 3:", "--max-new-tokens", "3", "-k", "2"]
    code, out, err = run_cli(capsys, *common, "--drafter", odd_pairs["rows200"])
    assert code == 2 and out == ""
    assert ("argument --vocab-size: the drafter has 200 output rows (token ids) and the verifier 78" in err
            and "pass --vocab-size 78 (the tokenizer has 78 tokens)" in err)
    code, _, err = run_cli(capsys, *common, "--drafter", odd_pairs["rows200"], "--vocab-size", "78")
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--drafter", odd_pairs["rows200"], "--vocab-size", "100")
    assert code == 2 and "--vocab-size must be an int in [1, 79)" in err
    # the drafter's folder has the verifier's tokenizer: the extra rows are padding, nothing to pass
    code, _, err = run_cli(capsys, *common, "--drafter", odd_pairs["rows200-same-tokenizer"])
    assert code == 0, err


def test_a_drafter_with_another_tokenizer_is_refused(capsys, pair_dirs, odd_pairs, tasks_file):
    verifier_dir, _ = pair_dirs
    code, out, err = run_cli(capsys, "evaluate", "--verifier", verifier_dir, "--drafter", odd_pairs["other-tokenizer"],
                             "--tasks", str(tasks_file), "--no-progress")
    assert code == 1 and out == ""
    other = odd_pairs["other-tokenizer"]
    assert f"--drafter: the drafter's tokenizer ({other}) differs from the tokenizer in use ({verifier_dir})" in err
    assert "74 of the ids both have map to different tokens" in err and "Traceback" not in err
    assert "use a drafter trained with the verifier's tokenizer" in err and "--tokenizer" not in err
    # --tokenizer is compared with the verifier's own tokenizer too, and the advice names the verifier's tokenizer as
    # the one to use (another drafter would not help)
    code, _, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", verifier_dir, "--tokenizer",
                           other, "--prompt", "a")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"--tokenizer: the verifier's tokenizer ({verifier_dir}) differs from the tokenizer in use ({other})" in err
    assert "so that must be the verifier's own tokenizer: leave out --tokenizer" in err and "use a drafter" not in err
    # a --tokenizer that the verifier's folder cannot confirm may be the wrong one: the advice says so
    code, _, err = run_cli(capsys, "generate", "--verifier", odd_pairs["short-drafter"], "--drafter", other,
                           "--tokenizer", verifier_dir, "--prompt", "a")
    assert code == 1 and "--drafter: the drafter's tokenizer" in err
    assert ("use a drafter trained with the verifier's tokenizer (or, if --tokenizer is not the verifier's tokenizer, "
            "pass the verifier's)") in err


def test_evaluate_bad_inputs(capsys, pair_dirs, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    common = ["--verifier", verifier_dir, "--drafter", drafter_dir]
    code, _, err = run_cli(capsys, "evaluate", *common, "--tasks", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "no such file" in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"task": "a", "text": "ok"}\n{oops\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "evaluate", *common, "--tasks", str(broken))
    assert code == 1 and "broken.jsonl:2" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "evaluate", *common, "--tasks", str(broken), "--max-examples", "zero")
    assert code == 2 and "--max-examples" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("x", encoding="utf-8")
    code, out, err = run_cli(capsys, "evaluate", *common, "--tasks", str(broken), "--output-dir", str(a_file))
    assert code == 2 and "argument --output-dir" in err and out == ""  # before the tasks are even read


# -------------------------------------------------------------------------------------------------------- finetune
def test_finetune_saves_a_loadable_drafter(capsys, pair_dirs, tasks_file, tmp_path):
    from transformers import AutoModelForCausalLM

    verifier_dir, drafter_dir = pair_dirs
    out_dir = tmp_path / "drafter-scdf"
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--steps", "2", "--batch-size-per-task", "2", "--seq-len", "16",
                             "--output", str(out_dir), "--no-progress", "--method", "scdf", "--weight-basis", "kl",
                             "--per-character")
    assert code == 0, err
    assert "saved the finetuned drafter" in out
    # the basis column holds per-character figures; the CE, KL and TV columns stay per token
    assert "| step | U (KL, per character) | U (CE, per token) | U (KL, per token) | U (TV, per token) |" in out
    summary = next(line for line in out.splitlines() if line.startswith("U ("))
    assert summary.startswith("U (KL, per character) ") and "U (KL) " not in out
    assert "evaluated on 1 held-out text(s) per task, not trained on (--eval-fraction 0.1, --split-seed 0)" in out
    finetuned = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    original = AutoModelForCausalLM.from_pretrained(drafter_dir, local_files_only=True)
    assert any(not torch.equal(a, b) for a, b in zip(finetuned.parameters(), original.parameters(), strict=True))
    # A non-empty output folder is refused unless --overwrite.
    code, _, err = run_cli(capsys, "finetune", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                           str(tasks_file), "--steps", "1", "--output", str(out_dir), "--no-progress")
    assert code == 2 and "--overwrite" in err


def test_finetune_evaluation_texts_and_positions(capsys, pair_dirs, odd_pairs, tasks_file, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    common = ["finetune", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks", str(tasks_file), "--steps",
              "1", "--batch-size-per-task", "2", "--seq-len", "16", "--no-progress"]
    code, out, err = run_cli(capsys, *common, "--eval-fraction", "0", "--output", str(tmp_path / "a"))
    assert code == 0 and "evaluated on training texts (--eval-fraction 0)" in out, err
    assert "| step | U (CE) | U (KL) | U (TV) | mean α |" in out and "per character" not in out
    code, out, err = run_cli(capsys, *common, "--eval-tasks", str(tasks_file), "--task-names", "copy",
                             "--method", "balanced", "--output", str(tmp_path / "b"))
    assert code == 0 and f"evaluated on --eval-tasks {tasks_file}" in out, err
    assert "| copy |" in out and "count" not in out.split("| step |")[1]  # only the task named
    code, _, err = run_cli(capsys, *common, "--eval-fraction", "1", "--output", str(tmp_path / "c"))
    assert code == 2 and "argument --eval-fraction: expected a number in [0, 1)" in err
    code, _, err = run_cli(capsys, "finetune", "--verifier", odd_pairs["short-verifier"], "--drafter",
                           odd_pairs["short-drafter"], "--tasks", str(tasks_file), "--seq-len", "100", "--output",
                           str(tmp_path / "d"))
    assert code == 2 and ("argument --seq-len: seq_len 100 is more than the models' 64 positions "
                          "(max_position_embeddings): use 64 or less") in err


def test_finetune_bad_inputs(capsys, pair_dirs, tasks_file, tmp_path):
    verifier_dir, drafter_dir = pair_dirs
    common = ["--verifier", verifier_dir, "--drafter", drafter_dir, "--output", str(tmp_path / "o")]
    code, _, err = run_cli(capsys, "finetune", *common, "--tasks", str(tasks_file), "--method", "magic")
    assert code == 2 and "--method" in err
    code, _, err = run_cli(capsys, "finetune", *common, "--tasks", str(tmp_path / "none.tsv"))
    assert code == 2 and "none.tsv" in err
    code, _, err = run_cli(capsys, "finetune", *common, "--tasks", str(tasks_file), "--lr", "0")
    assert code == 2 and "--lr" in err
    code, _, err = run_cli(capsys, "finetune", *common, "--tasks", str(tasks_file), "--seq-len", "1")
    assert code == 2 and "--seq-len" in err
    # unusable output folders are refused before any model is loaded or trained
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for option, target in (("--output", a_file / "sub"), ("--output", a_file), ("--checkpoint-dir", a_file)):
        args = [*common[:4], "--output", str(target if option == "--output" else tmp_path / "o2"), "--tasks",
                str(tasks_file)] + (["--checkpoint-dir", str(target)] if option == "--checkpoint-dir" else [])
        code, _, err = run_cli(capsys, "finetune", *args)
        assert code == 2 and f"argument {option}" in err, err


@pytest.mark.parametrize("command, option", [("finetune", "--seed"), ("finetune", "--split-seed"),
                                             ("generate", "--seed"), ("evaluate", "--seed")])
@pytest.mark.parametrize("value", [str(2**64), "-1"])
def test_seeds_outside_the_range_are_refused_naming_the_option(capsys, pair_dirs, tasks_file, tmp_path, command,
                                                               option, value):
    verifier_dir, drafter_dir = pair_dirs
    source = {"finetune": ["--tasks", str(tasks_file), "--output", str(tmp_path / "o")],
              "generate": ["--prompt", "a"], "evaluate": ["--tasks", str(tasks_file)]}[command]
    code, out, err = run_cli(capsys, command, "--verifier", verifier_dir, "--drafter", drafter_dir, *source, option,
                             value)
    assert code == 2 and out == ""
    assert f"argument {option}: expected an integer in [0, 2**64), got {value}" in err, err


def test_the_largest_seed_is_accepted(capsys, pair_dirs):
    verifier_dir, drafter_dir = pair_dirs
    code, out, err = run_cli(capsys, "generate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--prompt",
                             "a", "--seed", str(2**64 - 1), "--temperature", "1", "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["generated_tokens"] == 2, err


@pytest.mark.parametrize("method", ["uniform_kd", "balanced"])
def test_per_character_needs_a_method_with_task_weights(capsys, pair_dirs, tasks_file, tmp_path, method):
    from specdec.training.finetune import PER_CHARACTER_METHODS

    verifier_dir, drafter_dir = pair_dirs
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--output", str(tmp_path / "o"), "--method", method, "--per-character")
    assert code == 2 and out == "" and not (tmp_path / "o").exists()
    message = err.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("specdec finetune: error: argument --per-character: ")
    assert all(allowed in message[0] for allowed in PER_CHARACTER_METHODS) and f"--method {method}" in message[0]


@pytest.mark.parametrize("error", [ValueError("weight_floor must be at most 1, got 2.0"),
                                   TypeError("steps must be an int, got float")])
def test_another_refused_finetune_setting_is_reported_with_its_message(capsys, monkeypatch, pair_dirs, tasks_file,
                                                                      tmp_path, error):
    """A setting the options' types let through but FinetuneConfig refuses: a usage error of its message alone."""
    from specdec.training.finetune import FinetuneConfig

    def refuse(self):
        raise error

    monkeypatch.setattr(FinetuneConfig, "__post_init__", refuse)
    verifier_dir, drafter_dir = pair_dirs
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier_dir, "--drafter", drafter_dir, "--tasks",
                             str(tasks_file), "--output", str(tmp_path / "o"), "--weight-floor", "2", "--steps", "1")
    assert code == 2 and out == ""
    assert err == f"specdec finetune: error: {error}\n"


# ----------------------------------------------------------------------------------------------------------- bench
def test_bench_dry_run_lists_the_scripts(capsys):
    code, out, err = run_cli(capsys, "bench", "--dry-run", "--quick")
    assert code == 0, err
    assert "bench_rejection.py --quick" in out and "bench_divergence.py --quick" in out
    code, out, _ = run_cli(capsys, "bench", "divergence", "--dry-run", "--", "--no-fused")
    assert code == 0 and "bench_divergence.py --no-fused" in out and "bench_rejection" not in out


def test_bench_without_gpu_explains_and_cpu_smoke_runs(capsys):
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "bench")
        assert code == 1 and "no CUDA device" in err and "--cpu-smoke" in err
    code, out, err = run_cli(capsys, "bench", "--cpu-smoke")
    assert code == 0, err
    assert "| divergence |" in out and "rejection_sample" in out
    for extra in (["divergence"], ["--quick"], ["--dry-run"], ["--", "--no-fused"]):
        code, _, err = run_cli(capsys, "bench", "--cpu-smoke", *extra)
        assert code == 2 and "--cpu-smoke" in err


def test_bench_from_an_installed_package_says_what_it_needs(tmp_path):
    """A package installed without the repository (here: a copy of specdec/ with kernels/ as specdec.kernels, as
    setup.py lays them out) has no benchmarks: exit 2 with one message naming the checkout, the GPU and the command;
    the CPU smoke run still works there."""
    import shutil

    from specdec.cli.bench import CHECKOUT_COMMAND

    site = tmp_path / "site-packages"
    shutil.copytree(REPO_ROOT / "specdec", site / "specdec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "kernels", site / "specdec" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site), "SPECDEC_DEBUG": ""}
    script = "import sys, specdec; from specdec.cli import main; print(specdec.__file__); sys.exit(main(sys.argv[1:]))"
    for argv in (["bench"], ["bench", "divergence", "--quick", "--dry-run"]):
        run = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                             cwd=tmp_path)
        assert run.stdout.strip() == str(site / "specdec" / "__init__.py"), "the copy must be the package imported"
        assert run.returncode == 2, run.stderr
        message = run.stderr.strip()
        assert len(message.splitlines()) == 1 and "Traceback" not in message
        assert "source checkout" in message and "CUDA GPU" in message and CHECKOUT_COMMAND in message
    smoke = subprocess.run([sys.executable, "-c", script, "bench", "--cpu-smoke"], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
    assert smoke.returncode == 0 and "| divergence |" in smoke.stdout, smoke.stderr


def test_bench_bad_inputs(capsys, tmp_path):
    assert run_cli(capsys, "bench", "everything")[0] == 2
    code, _, err = run_cli(capsys, "bench", "--benchmarks-dir", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere" in err
    code, _, err = run_cli(capsys, "bench", "--benchmarks-dir", str(tmp_path), "--dry-run")
    assert code == 1 and "benchmark script not found" in err


# ------------------------------------------------------------------------------------------------------------ demo
def test_demo_quick_writes_where_asked(capsys, tmp_path):
    out_dir, cache_dir = tmp_path / "report", tmp_path / "cache"
    code, out, err = run_cli(capsys, "demo", "--quick", "--no-progress", "--output-dir",
                             str(out_dir), "--cache-dir", str(cache_dir))
    assert code == 0, err
    assert (out_dir / "report.md").is_file() and "Fairness after s-CDF" in out
    assert any(cache_dir.glob("demo-pair-*/pair.json"))


def test_demo_refuses_the_source_tree_and_bad_options(capsys, tmp_path):
    code, _, err = run_cli(capsys, "demo", "--quick", "--output-dir", str(REPO_ROOT / "specdec" / "report"),
                           "--cache-dir", str(tmp_path))
    assert code == 2 and "source tree" in err
    assert not (REPO_ROOT / "specdec" / "report").exists()
    code, _, err = run_cli(capsys, "demo", "--finetune-steps", "-3")
    assert code == 2 and "--finetune-steps" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("x", encoding="utf-8")
    code, _, err = run_cli(capsys, "demo", "--quick", "--cache-dir", str(a_file), "--output-dir", str(tmp_path / "r"))
    assert code == 2 and "--cache-dir" in err and "exists and is not a folder" in err


@pytest.fixture(scope="module")
def deep_verifier_dir(tmp_path_factory) -> str:
    """A three-layer verifier (with the tokenizer): room for a layer-skip self-drafter."""
    root = tmp_path_factory.mktemp("deep")
    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=3, seed=4, init_std=0.3)
    verifier.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


def test_self_drafter_generates_the_verifiers_tokens_and_finetunes_a_copy(capsys, deep_verifier_dir, tasks_file,
                                                                          tmp_path):
    from transformers import AutoModelForCausalLM

    code, out, err = run_cli(capsys, "generate", "--verifier", deep_verifier_dir, "--self-drafter", "1", "--prompt",
                             "count 3:", "-k", "3", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["completion"] == _greedy_completion(deep_verifier_dir, "count 3:", 8)
    verifier = AutoModelForCausalLM.from_pretrained(deep_verifier_dir).eval()
    out_dir = tmp_path / "self-drafter"
    code, out, err = run_cli(capsys, "finetune", "--verifier", deep_verifier_dir, "--self-drafter", "2", "--tasks",
                             str(tasks_file), "--steps", "1", "--batch-size-per-task", "2", "--seq-len", "16",
                             "--output", str(out_dir), "--no-progress")
    assert code == 0, err
    saved = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    assert saved.config.num_hidden_layers == 2
    unchanged = AutoModelForCausalLM.from_pretrained(deep_verifier_dir, local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(unchanged.parameters(), verifier.parameters(), strict=True))
    for options, message in ((["--self-drafter", "3"], "argument --self-drafter: num_layers must be an integer in"),
                             (["--self-drafter", "1", "--drafter", deep_verifier_dir], "not allowed with argument")):
        code, _, err = run_cli(capsys, "generate", "--verifier", deep_verifier_dir, "--prompt", "a", *options)
        assert code == 2 and message in err and "Traceback" not in err
