"""``specdec finetune``: finetune the drafter with s-CDF or a baseline, print the evaluations, save it.

A checkpoint is always written while training (``--checkpoint-dir``, default ``<output>.checkpoint``, removed once the
drafter is saved), so Ctrl-C finishes the step under way, saves it, and prints the command that resumes: the same
command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from specdec._paths import follow_umask
from specdec.cli.loading import UsageError, check_output_folder, load_pair, load_task_source

RESUME_EXIT_CODE = 130  # as for any command stopped by Ctrl-C


def default_checkpoint_dir(output: Path) -> Path:
    """Where ``specdec finetune --output OUTPUT`` keeps its checkpoint without ``--checkpoint-dir``: the folder
    ``OUTPUT.checkpoint`` beside it."""
    output = Path(os.path.abspath(output))  # "." and "out/" have a name too
    return output.with_name(output.name + ".checkpoint")


def resume_command(argv: list[str]) -> str:
    """The command line that resumes an interrupted ``specdec finetune`` (``argv`` without ``--no-resume``)."""
    return shlex.join(["specdec", *(arg for arg in argv if arg != "--no-resume")])


def history_table(result: Any, per_character: bool) -> list[str]:
    """Lines of the evaluations' table and of the before/after summary: U on CE, KL and TV per token, with the
    per-character U on the weight basis first when the weights were taken per character (each figure once)."""
    basis = result.weight_basis.upper()
    columns = [("U (CE)", "U_ce"), ("U (KL)", "U_kl"), ("U (TV)", "U_tv")]
    label = f"U ({basis})"
    if per_character:
        label = f"U ({basis}, per character)"
        columns = [(label, "U"), *((f"{name[:-1]}, per token)", key) for name, key in columns)]
    lines = ["| step | " + " | ".join(name for name, _ in columns) + " | mean α | worst α | worst task |",
             "|---|" + "---|" * (len(columns) + 3)]
    for entry in result.history:
        cells = [f"{entry[key]:.4g}" for _, key in columns]
        lines.append(f"| {entry['step']} | " + " | ".join(cells) + f" | {entry['mean_alpha']:.4g} | "
                     f"{entry['worst_alpha']:.4g} | {entry['worst_task']} |")
    first, last = result.initial, result.final
    change = (last["U"] - first["U"]) / first["U"] if first["U"] else 0.0
    lines.append(f"{label} {first['U']:.4g} -> {last['U']:.4g} ({change:+.0%}); mean α {first['mean_alpha']:.4g} -> "
                 f"{last['mean_alpha']:.4g}; worst α {first['worst_alpha']:.4g} -> {last['worst_alpha']:.4g}")
    return lines


def command_finetune(args: argparse.Namespace) -> int:
    """Finetune the drafter with s-CDF or a baseline and save it (with the tokenizer) to ``--output``."""
    from specdec.training.checkpoint import CHECKPOINT_NAME, CheckpointError
    from specdec.training.config import PER_CHARACTER_METHODS, FinetuneConfig, zero_weight_formula
    from specdec.training.finetune import FinetuneInterrupted, check_seq_len, finetune_drafter

    if args.per_character and args.method not in PER_CHARACTER_METHODS:
        raise UsageError(f"argument --per-character: needs --method {' or '.join(PER_CHARACTER_METHODS)} (the methods "
                         f"with per-task weights), got --method {args.method}")
    checkpoint_dir = args.checkpoint_dir or default_checkpoint_dir(args.output)
    try:
        config = FinetuneConfig(method=args.method, weight_basis=args.weight_basis, weight_floor=args.weight_floor,
                                steps=args.steps, batch_size_per_task=args.batch_size_per_task, seq_len=args.seq_len,
                                lr=args.lr, eval_every=args.eval_every, eval_fraction=args.eval_fraction,
                                eval_examples=args.eval_examples, split_seed=args.split_seed,
                                checkpoint_dir=checkpoint_dir, resume=not args.no_resume, seed=args.seed,
                                per_character=args.per_character, mixture_weight=args.mixture_weight,
                                normalize_weights=args.mixture_weight > 0)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    tasks = load_task_source(args.tasks, args.max_examples, args.task_names)
    formula = zero_weight_formula(config, len(tasks))
    if formula is not None:
        floor = ", or --weight-floor above 0 (the floor becomes its weight)" if config.method == "scdf" else ""
        raise UsageError(f"argument --method: {config.method} needs at least 2 tasks: with the one task "
                         f"{next(iter(tasks))!r} its weight {formula} is 0 and the drafter would not change. Give "
                         f"more tasks (--tasks, --task-names), or use --method uniform_kd or balanced (distillation "
                         f"on the one task), --mixture-weight above 0{floor}")
    texts = {name: list(task.texts or task.prompts) for name, task in tasks.items()}
    eval_texts = None
    if args.eval_tasks is not None:
        eval_texts = {name: list(task.texts or task.prompts)
                      for name, task in load_task_source(args.eval_tasks, args.max_examples, args.task_names).items()}
    check_output_folder(args.output, "--output")
    if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
        raise UsageError(f"argument --output: {args.output} exists and is not empty (pass --overwrite)")
    check_output_folder(checkpoint_dir, "--checkpoint-dir")
    verifier, drafter, tokenizer, vocab_size = load_pair(args)
    try:
        check_seq_len(config.seq_len, verifier, drafter)
    except ValueError as error:
        raise UsageError(f"argument --seq-len: {error}") from None
    try:
        result = finetune_drafter(
            drafter, verifier, texts, config=config, tokenizer=tokenizer, progress=not args.no_progress,
            eval_tasks=eval_texts, add_special_tokens=not args.no_special_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, vocab_size=vocab_size,
        )
    except FinetuneInterrupted as stop:
        print(f"specdec finetune: interrupted after step {stop.step} of {stop.steps}; checkpoint saved in "
              f"{checkpoint_dir}. To resume, run the same command again:\n  "
              f"{resume_command(getattr(args, 'argv', []))}", file=sys.stderr)
        return RESUME_EXIT_CODE
    except CheckpointError as error:
        raise UsageError(f"{error} (on the command line: --checkpoint-dir elsewhere, or --no-resume)") from None
    saving = time.time() - 1.0  # (file times may be coarser than time.time())
    args.output.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    follow_umask(args.output, since=saving)  # safetensors writes 0600 files; the saved drafter is ordinary files
    print(f"method {result.method}, weight basis {result.weight_basis}, {result.steps} steps")
    if result.held_out is not None:
        counts = sorted({len(indices) for indices in result.held_out.values()})
        print(f"evaluated on {'-'.join(map(str, counts[::max(len(counts) - 1, 1)]))} held-out text(s) per task, "
              f"not trained on (--eval-fraction {config.eval_fraction:g}, --split-seed {config.split_seed})")
    elif eval_texts is not None:
        print(f"evaluated on --eval-tasks {args.eval_tasks}")
    else:
        print("evaluated on training texts (--eval-fraction 0): the U and α figures measure fit, not held-out "
              "performance")
    print("\n".join(history_table(result, config.per_character)))
    print(f"saved the finetuned drafter to {args.output}")
    if args.checkpoint_dir is None:  # the default checkpoint only served this run
        (checkpoint_dir / CHECKPOINT_NAME).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # left in place if something else is in it
            checkpoint_dir.rmdir()
    return 0
