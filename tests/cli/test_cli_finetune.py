"""``specdec finetune`` and the CPU threads of the commands: one-task runs, resuming another drafter, Ctrl-C and the
command that resumes, and --threads."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
import torch

from specdec import data
from specdec.cli import build_parser, main
from specdec.cli import loading as cli_loading
from specdec.training import finetune as finetune_module

from models import tiny_llama


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str, str]:
    """A two-layer verifier (with the tokenizer), a one-layer drafter of the verifier's width (the architecture of
    the verifier's first layer as a self-drafter), and a task file."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, seed=0)
    tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=1).save_pretrained(root / "drafter")
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    suite = data.synthetic_task_suite(4, seed=0, tasks=["count", "copy"])
    rows = [{"task": task, "prompt": ex.prompt, "text": ex.text} for task, examples in suite.items() for ex in examples]
    (root / "tasks.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return str(root / "verifier"), str(root / "drafter"), str(root / "tasks.jsonl")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def finetune_args(pair, output: Path, *extra: str) -> list[str]:
    verifier, drafter, tasks = pair
    return ["finetune", "--verifier", verifier, "--drafter", drafter, "--tasks", tasks, "--steps", "4",
            "--batch-size-per-task", "2", "--seq-len", "16", "--eval-every", "3", "--no-progress", "--output",
            str(output), *extra]


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_one_task_scdf_is_refused_before_anything_runs(capsys, pair, tmp_path):
    verifier, drafter, _ = pair
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier, "--drafter", drafter, "--tasks", "mgsm",
                             "--task-names", "en", "--steps", "5", "--output", str(tmp_path / "o"))
    assert code == 2 and out == "" and not (tmp_path / "o").exists()
    assert err.startswith("specdec finetune: error: argument --method: scdf needs at least 2 tasks: with the one task "
                          "'en' its weight K_i - min_j K_j is 0")
    assert "--method uniform_kd or balanced" in err and "--weight-floor" in err and "--mixture-weight" in err
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier, "--drafter", drafter, "--tasks", "mgsm",
                             "--task-names", "en", "--steps", "1", "--max-examples", "4", "--seq-len", "16",
                             "--method", "balanced", "--no-progress", "--output", str(tmp_path / "b"))
    assert code == 0 and "saved the finetuned drafter" in out, err


def test_the_mixture_weight_is_checked_and_trains_one_task(capsys, pair, tmp_path):
    verifier, drafter, _ = pair
    one_task = ["finetune", "--verifier", verifier, "--drafter", drafter, "--tasks", "mgsm", "--task-names", "en",
                "--max-examples", "4", "--seq-len", "16", "--steps", "1", "--no-progress"]
    for extra, needle in ((["--mixture-weight", "1.5"], r"mixture_weight must be in [0, 1]"),
                          (["--mixture-weight", "0.5", "--method", "uniform_kd"],
                           "method 'uniform_kd' has no corrective term")):
        code, out, err = run_cli(capsys, *one_task, *extra, "--output", str(tmp_path / "bad"))
        assert code == 2 and out == "" and needle in err and not (tmp_path / "bad").exists(), err
    code, out, err = run_cli(capsys, *one_task, "--mixture-weight", "0.5", "--output", str(tmp_path / "o"))
    assert code == 0 and "saved the finetuned drafter" in out, err
    assert not torch.equal(saved_weights(tmp_path / "o")["lm_head.weight"],
                           saved_weights(Path(drafter))["lm_head.weight"])


def test_resuming_with_another_drafter_is_refused(capsys, pair, tmp_path):
    verifier, _, tasks = pair
    checkpoint = tmp_path / "ck"
    code, _, err = run_cli(capsys, *finetune_args(pair, tmp_path / "a", "--steps", "2", "--checkpoint-dir",
                                                  str(checkpoint)))
    assert code == 0 and (checkpoint / finetune_module.CHECKPOINT_NAME).exists(), err
    # the verifier's first layer: a one-layer drafter like the first run's, with other weights
    code, out, err = run_cli(capsys, "finetune", "--verifier", verifier, "--self-drafter", "1", "--tasks", tasks,
                             "--steps", "4", "--batch-size-per-task", "2", "--seq-len", "16", "--no-progress",
                             "--checkpoint-dir", str(checkpoint), "--output", str(tmp_path / "b"))
    assert code == 2 and not (tmp_path / "b").exists()
    assert "written while finetuning another drafter" in err and "--no-resume" in err


def test_ctrl_c_saves_a_checkpoint_and_prints_the_command_that_resumes(capsys, pair, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    code, _, err = run_cli(capsys, *finetune_args(pair, whole))
    assert code == 0 and not default_checkpoint(whole).exists(), err

    draw = finetune_module._draw_global_batch
    calls = []

    def ctrl_c_in_step_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return draw(*args, **kwargs)

    monkeypatch.setattr(finetune_module, "_draw_global_batch", ctrl_c_in_step_two)
    output = tmp_path / "drafter out"  # a space: the printed command must quote it
    argv = finetune_args(pair, output)
    code, out, err = run_cli(capsys, *argv, "--no-resume")
    assert code == 130 and not output.exists()
    assert "interrupted after step 2 of 4; checkpoint saved in" in err
    resume_line = err.strip().splitlines()[-1].strip()
    assert resume_line.startswith("specdec finetune --verifier ") and "'" + str(output) + "'" in resume_line
    assert "--no-resume" not in resume_line
    monkeypatch.setattr(finetune_module, "_draw_global_batch", draw)
    previous = os.umask(0o022)
    try:
        code, out, err = run_cli(capsys, *argv)  # the same command, as printed
    finally:
        os.umask(previous)
    assert code == 0 and "saved the finetuned drafter" in out, err
    assert stat.S_IMODE((output / "model.safetensors").stat().st_mode) == 0o644  # not safetensors' 0600
    assert not default_checkpoint(output).exists()
    resumed, uninterrupted = saved_weights(output), saved_weights(whole)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)


def default_checkpoint(output: Path) -> Path:
    return output.with_name(output.name + ".checkpoint")


# ---------------------------------------------------------------------------------------------------------- threads
def test_every_command_that_runs_torch_has_a_threads_option():
    commands = {action.dest: action for action in build_parser()._subparsers._group_actions}["command"].choices
    for name in ("generate", "evaluate", "finetune", "demo"):
        assert "--threads" in commands[name]._option_string_actions, name


@pytest.mark.parametrize("given, idle, expected", [(["--threads", "1"], 5.0, 1), ([], 1.2, 1), ([], None, 2),
                                                   ([], 7.0, 2)])
def test_threads_are_set_for_the_command_and_put_back(capsys, pair, monkeypatch, given, idle, expected):
    from specdec.decoding import generation

    seen = []
    generate = generation.generate

    def record(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return generate(*args, **kwargs)

    monkeypatch.setattr(generation, "generate", record)
    monkeypatch.setattr(cli_loading, "idle_cpus", lambda interval=0.1: idle)
    verifier, drafter, _ = pair
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default here: the most the default takes
    try:
        code, _, err = run_cli(capsys, "generate", "--verifier", verifier, "--drafter", drafter, "--prompt", "ab",
                               "--max-new-tokens", "2", "--json", *given)
        assert code == 0, err
        assert seen == [expected] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_idle_cpus_reads_a_share_of_the_cpus_this_process_may_use():
    idle = cli_loading.idle_cpus(0.05)
    if not hasattr(os, "sched_getaffinity"):
        assert idle is None
    else:
        assert 0.0 <= idle <= len(os.sched_getaffinity(0)) + 1e-9


def test_the_demo_pair_folder_follows_the_umask(tmp_path):
    from specdec.cli import demo

    previous = os.umask(0o022)
    try:
        pair = demo.get_demo_pair(tmp_path, config=demo.default_pair_config(quick=True), progress=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(pair.path.stat().st_mode) == 0o755
    assert stat.S_IMODE((pair.path / "drafter" / "model.safetensors").stat().st_mode) == 0o644
