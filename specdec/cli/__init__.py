"""The ``specdec`` command line: ``generate``, ``evaluate``, ``finetune``, ``bench`` and ``demo``.

Models are Hugging Face model ids or local folders and are always loaded offline (``local_files_only=True``,
``HF_HUB_OFFLINE=1``): nothing is downloaded. Exit codes: 0 success, 1 runtime error (unreadable file contents, a
model that fails to load, no GPU for the benchmarks), 2 usage error (unknown option, bad value, missing file, the
benchmarks asked for without a source checkout). Errors are one message on stderr, never a traceback (set
``SPECDEC_DEBUG=1`` to see it). ``bench`` lives in :mod:`specdec.cli.bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specdec.cli.finetune import command_finetune
from specdec.cli.loading import (
    DTYPES,
    CommandError,
    UsageError,
    check_output_folder,
    default_threads,
    load_pair,
    load_task_source,
)

PROGRAM = "specdec"
DEFAULT_MAX_LENGTH = 512  # tokens per reference text in evaluate, unless the models have fewer positions


# ----------------------------------------------------------------------------------------------------------------------
# Argument types and shared options
# ----------------------------------------------------------------------------------------------------------------------


def _int_at_least(minimum: int, below: int | None = None, below_text: str | None = None):
    """argparse type: an integer >= ``minimum`` (and < ``below`` when given, shown as ``below_text``)."""
    wanted = f"an integer >= {minimum}" if below is None else f"an integer in [{minimum}, {below_text or below})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < minimum or (below is not None and value >= below):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_seed = _int_at_least(0, 2**64, "2**64")  # the seeds specdec's functions accept


def _draft_tokens_or_auto(text: str) -> int | str:
    """K >= 0 (0 = plain decoding) or "auto" for ``specdec generate``."""
    return "auto" if text == "auto" else _non_negative_int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _temperature(text: str) -> float:
    from specdec._validation import MIN_TEMPERATURE

    value = _non_negative_float(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a number >= {MIN_TEMPERATURE:g}, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _fraction(text: str) -> float:
    value = _non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def _existing_path(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return path


def _task_source(text: str) -> Path | str:
    """argparse type of ``--tasks``: an existing file or folder, else the name of a built-in data set."""
    from specdec.data import BUILTIN_DATASETS

    path = Path(text).expanduser()
    if path.exists():
        return path
    if text in BUILTIN_DATASETS:
        return text
    raise argparse.ArgumentTypeError(f"no such file or folder: {text} (built-in data sets: "
                                     f"{', '.join(BUILTIN_DATASETS)})")


def _name_list(text: str) -> list[str]:
    """argparse type: comma-separated names, none empty."""
    names = [name.strip() for name in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated task names such as en,de,bn, got {text!r}")
    return names


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty stop string")
    return text.replace("\\n", "\n")


def _existing_file(text: str) -> Path:
    path = _existing_path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"not a file: {text}")
    return path


def _add_model_options(parser: argparse.ArgumentParser, *, finetuning: bool = False) -> None:
    group = parser.add_argument_group("models (Hugging Face ids already in the local cache, or local folders)")
    group.add_argument("--verifier", required=True, help="the large model whose outputs are kept")
    drafter = group.add_mutually_exclusive_group(required=True)
    drafter.add_argument("--drafter", help="the small model that proposes tokens")
    drafter.add_argument("--self-drafter", type=_positive_int, default=None, metavar="N",
                         help="use the verifier's first N layers with its final norm and head as the drafter "
                              + ("(a copy, which is finetuned and saved)" if finetuning
                                 else "(shared weights: no extra memory)"))
    parser.set_defaults(self_drafter_copy=finetuning)
    group.add_argument("--tokenizer", default=None, help="tokenizer id or folder (default: the verifier's)")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights dtype (default: auto = float32 on CPU, the checkpoint's dtype on GPU)")
    group.add_argument("--vocab-size", type=_positive_int, default=None, metavar="N",
                       help="token ids the two models share; needed when their output layers differ in size and the "
                            "drafter's folder has no tokenizer to compare with the verifier's (default: every id "
                            "when the sizes agree, else the tokenizer's size when both models' tokenizers match)")


def _add_decoding_options(parser: argparse.ArgumentParser, *, temperature: float, max_new_tokens: int,
                          generating: bool = False) -> None:
    group = parser.add_argument_group("speculative decoding")
    if generating:
        group.add_argument("-k", "--num-draft-tokens", type=_draft_tokens_or_auto, default=4, metavar="K",
                           help="drafts per verifier call; 0 = plain decoding, auto = chosen per round from the "
                                "measured acceptance and round times (default: 4)")
        group.add_argument("--no-static", dest="static", action="store_false", default=None,
                           help="use the eager path (dynamic caches) instead of the static path on CUDA")
        group.add_argument("--compile", action="store_true",
                           help="fuse each model's forward with torch.compile on the static path (tens of seconds "
                                "once, faster steps after)")
        group.add_argument("--verification", default="token", choices=("token", "block"),
                           help="how sampled rounds verify their drafts: token = each draft on its own, block = the "
                                "drafts jointly (Sun et al., ICLR 2025; equally lossless, never fewer accepted "
                                "drafts in expectation); greedy decoding is the arg-max rule under both "
                                "(default: token)")
    else:
        group.add_argument("-k", "--num-draft-tokens", type=_positive_int, default=4, metavar="K",
                           help="drafts per verifier call (default: 4)")
    group.add_argument("--temperature", type=_temperature, default=temperature,
                       help=f"sampling temperature, 0 = greedy (default: {temperature})")
    group.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens,
                       help=f"tokens to generate per prompt (default: {max_new_tokens})")
    group.add_argument("--seed", type=_seed, default=0, help="random seed (default: 0)")
    group.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                       help="kernel backend: auto = Triton on CUDA, torch reference elsewhere (default: auto)")
    group.add_argument("--batch-size", type=_positive_int, default=8, help="prompts per batch (default: 8)")


def _add_input_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--no-special-tokens", action="store_true",
                        help=f"do not add the tokenizer's special tokens (BOS etc.) to {what}")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="torch CPU threads; more threads than idle cores slow torch down many times over "
                             "(default: the cores found idle at the start, at most torch's own default)")


@contextlib.contextmanager
def _torch_threads(args: argparse.Namespace) -> Iterator[None]:
    """torch's CPU threads set to ``--threads`` (or :func:`specdec.cli.loading.default_threads`) while a command
    with that option runs, and put back after."""
    if not hasattr(args, "threads"):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(args.threads or default_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _subcommand(commands: Any, name: str, handler: Any, *, help: str, description: str,
                epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser that runs ``handler(args)``."""
    parser = commands.add_parser(name, help=help, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(handler=handler)
    return parser


def command_generate(args: argparse.Namespace) -> int:
    """Speculative decoding of one or more prompts; prints the completions and the acceptance statistics."""
    import torch

    from specdec._seeding import derive_seed
    from specdec.data import TaskFileError, read_prompts_file
    from specdec.decoding.generation import generate

    if args.prompts_file is not None:
        try:
            prompts = read_prompts_file(args.prompts_file)
        except TaskFileError as error:
            raise CommandError(str(error)) from None
    else:
        prompts = [prompt.replace("\\n", "\n") for prompt in args.prompt]
        if any(not prompt for prompt in prompts):
            raise UsageError("argument --prompt: prompts must not be empty")
    verifier, drafter, tokenizer, vocab_size = load_pair(args)
    eos = args.eos_token_id if args.eos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    from specdec._models import model_vocab_size

    ids = vocab_size or min(model_vocab_size(verifier), model_vocab_size(drafter))
    if args.eos_token_id is not None and args.eos_token_id >= ids:
        raise UsageError(f"argument --eos-token-id: {args.eos_token_id} is not a token id of these models "
                         f"(they have {ids})")
    device = next(verifier.parameters()).device
    totals = {"generated": 0, "verifier_calls": 0, "drafted": 0, "accepted": 0, "wall_time_s": 0.0}
    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc="specdec generate", unit="prompt", disable=args.no_progress or len(prompts) < 2)
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start:start + args.batch_size]
        batch = tokenizer(chunk, add_special_tokens=not args.no_special_tokens, padding=True, return_tensors="pt")
        input_ids, attention_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        if input_ids.shape[1] == 0 or bool((attention_mask.sum(1) == 0).any()):
            raise CommandError("a prompt encodes to no tokens")
        streamer = None
        if len(chunk) == 1 and not (args.json or args.no_stream):
            from transformers import TextStreamer

            print(f"### prompt {start + 1}: {chunk[0]!r}\n{chunk[0]}", end="", flush=True)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.no_grad():
            out = generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=args.max_new_tokens,
                           num_draft_tokens=args.num_draft_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, eos_token_id=eos, seed=derive_seed(args.seed, start), backend=args.backend,
                           pad_token_id=pad, vocab_size=vocab_size, static=args.static, compile=args.compile,
                           repetition_penalty=args.repetition_penalty, min_new_tokens=args.min_new_tokens,
                           stop_strings=args.stop, tokenizer=tokenizer if args.stop else None, streamer=streamer,
                           verification=args.verification)
        stats = out.stats
        width = input_ids.shape[1]
        for row, prompt in enumerate(chunk):
            new_tokens = out.sequences[row, width:width + int(stats.generated[row])].tolist()
            completion = tokenizer.decode(new_tokens, skip_special_tokens=True)
            record = {
                "prompt": prompt, "completion": completion, "generated_tokens": int(stats.generated[row]),
                "drafted": int(stats.drafted[row]), "accepted": int(stats.accepted[row]),
                "verifier_calls": int(stats.verifier_calls[row]),
                "tokens_per_verifier_call": float(stats.tokens_per_verifier_call[row]),
            }
            summary = (f"[{record['generated_tokens']} tokens, {record['verifier_calls']} verifier calls, "
                       f"{record['tokens_per_verifier_call']:.2f} tokens/call, "
                       f"{record['accepted']}/{record['drafted']} drafts accepted]\n")
            if args.json:
                print(json.dumps(record, ensure_ascii=False))
            elif streamer is not None:  # (the streamer printed the completion and ended its line)
                print(summary)
            else:
                print(f"### prompt {start + row + 1}: {prompt!r}\n{prompt}{completion}\n{summary}")
        for key in ("generated", "verifier_calls", "drafted", "accepted"):
            totals[key] += int(getattr(stats, key).sum())
        totals["wall_time_s"] += stats.wall_time_s
        bar.update(len(chunk))
    bar.close()
    summary = (f"{len(prompts)} prompt(s): {totals['generated']} tokens, "
               f"{totals['generated'] / max(totals['verifier_calls'], 1):.2f} tokens per verifier call, acceptance "
               f"{totals['accepted'] / max(totals['drafted'], 1):.3f}, {totals['wall_time_s']:.2f} s")
    print(summary, file=sys.stderr if args.json else sys.stdout)
    return 0


def _write_report(report: Any, output_dir: Path | None, title: str) -> list[Path]:
    if output_dir is None:
        return []
    output_dir.mkdir(parents=True, exist_ok=True)
    markdown, data, plot = output_dir / "report.md", output_dir / "report.json", output_dir / "report.png"
    markdown.write_text(f"# {title}\n\n{report.to_markdown()}\n![fairness plot](report.png)\n", encoding="utf-8")
    data.write_text(json.dumps(report.to_dict(), indent=2, default=str), encoding="utf-8")
    report.plot(str(plot))
    return [markdown, data, plot]


def command_evaluate(args: argparse.Namespace) -> int:
    """Per-task fairness report of a drafter-verifier pair over task files."""
    from specdec.compat import pair_positions
    from specdec.fairness import evaluate

    if args.output_dir is not None:
        check_output_folder(args.output_dir, "--output-dir")
    tasks = load_task_source(args.tasks, args.max_examples, args.task_names)
    verifier, drafter, tokenizer, vocab_size = load_pair(args)
    positions = pair_positions(verifier, drafter)
    max_length = args.max_length or min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH)
    report = evaluate(
        verifier, drafter, tasks, tokenizer=tokenizer, num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        max_examples=args.max_examples, cost_ratio=args.cost_ratio, seed=args.seed, progress=not args.no_progress,
        backend=args.backend, max_length=max_length, eos_token_id=tokenizer.eos_token_id, vocab_size=vocab_size,
        add_special_tokens=not args.no_special_tokens, wall_clock=args.wall_clock,
        wall_clock_repeats=args.wall_clock_repeats, wall_clock_baseline=args.wall_clock_baseline,
    )
    print(report.to_markdown())
    written = _write_report(report, args.output_dir, f"specdec fairness report: {args.tasks}")
    if written:
        print("wrote " + ", ".join(str(path) for path in written))
    return 0


def command_demo(args: argparse.Namespace) -> int:
    """The offline demo (see :mod:`specdec.demo`)."""
    import torch

    from specdec.cli.demo import run_demo

    torch.set_num_threads(args.threads)
    result = run_demo(
        output_dir=args.output_dir, cache_dir=args.cache_dir, quick=args.quick, seed=args.seed,
        baselines=args.baselines, retrain=args.retrain, finetune_steps=args.finetune_steps,
        cost_ratio=args.cost_ratio, wall_clock=args.wall_clock, progress=not args.no_progress,
    )
    print(f"done in {result.timings['total_seconds']:.0f} s "
          f"({'pair loaded from the cache' if result.cache_hit else 'pair trained and cached'})")
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------------------------------

_MAIN_EPILOG = """\
quick start (CPU, offline, a few minutes):
  specdec demo                           train a tiny pair, show the disparity, fix it with s-CDF

examples:
  specdec generate --verifier ./big --drafter ./small --prompt "2+2=" --temperature 0
  specdec evaluate --verifier ./big --drafter ./small --tasks tasks.jsonl --output-dir report/
  specdec evaluate --verifier ./big --drafter ./small --tasks mgsm --task-names en,de,bn --max-examples 50
  specdec finetune --verifier ./big --drafter ./small --tasks tasks.jsonl --output ./small-scdf
  specdec bench --quick                  (a source checkout and a CUDA GPU; --cpu-smoke otherwise)

exit codes: 0 success, 1 runtime error, 2 usage error (bad option or value, missing file)
"""

_TASK_FILES_HELP = (
    "a task file: .jsonl/.json rows with 'prompt'/'question' and 'text'/'response'/'answer' fields (and 'task', else "
    "the file name), .tsv ('task<TAB>text' with that header, or 'question<TAB>answer' rows), .txt (one text per "
    "line), or a folder with one file per language: <name>_<lang>.tsv/.json/.jsonl or <name>.<lang>.txt, task = lang "
    "as MGSM codes it (MGSM, MSVAMP, mCoT outputs and NTREX-128 folders load as they come)")


def _tasks_help() -> str:
    """The help of ``--tasks``: the built-in data sets (from :data:`specdec.data.BUILTIN_DATASETS`), or a file."""
    from specdec.data import BUILTIN_DATASETS

    builtin = ", ".join(f"{name!r} ({dataset.description}, tasks {' '.join(dataset.tasks)}; shipped with specdec, "
                        f"{dataset.license})" for name, dataset in BUILTIN_DATASETS.items())
    return f"the built-in data set {builtin}, or {_TASK_FILES_HELP}"


_TASK_NAMES_HELP = "keep only these tasks, comma-separated, e.g. en,de,bn (default: every task)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``specdec`` command."""
    from specdec import __version__

    parser = argparse.ArgumentParser(
        prog=PROGRAM, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_MAIN_EPILOG,
        description="Fast, lossless and fair speculative decoding: run it, measure its per-task disparity, and "
                    "reduce it with s-CDF drafter finetuning.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    generate = _subcommand(
        commands, "generate", command_generate, help="speculative decoding of prompts with a verifier/drafter pair",
        description="Generate with speculative decoding; the output follows the verifier exactly.",
        epilog="examples:\n  specdec generate --verifier ./big --drafter ./small --prompt 'count 7:' -k 4\n"
               "  specdec generate --verifier Qwen/Qwen2.5-7B --drafter Qwen/Qwen2.5-0.5B --prompts-file p.txt "
               "--device cuda --dtype bfloat16 --temperature 0.7 --top-p 0.9 --json\n\n"
               "A prompts file has one prompt per line (\\n inside a line is a newline) or is .jsonl with a "
               "'prompt' field.")
    _add_model_options(generate)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument("--prompts-file", type=_existing_file, help="a file of prompts")
    _add_decoding_options(generate, temperature=0.0, max_new_tokens=64, generating=True)
    generate.add_argument("--top-k", type=_non_negative_int, default=0,
                          help="keep the k likeliest tokens, 0 = off (default: 0)")
    generate.add_argument("--top-p", type=_probability, default=1.0,
                          help="nucleus sampling mass in (0, 1], 1 = off (default: 1.0)")
    generate.add_argument("--eos-token-id", type=_non_negative_int, default=None,
                          help="stop token (default: the tokenizer's)")
    generate.add_argument("--repetition-penalty", type=_positive_float, default=1.0, metavar="THETA",
                          help="transformers' repetition penalty on every token of the prompt and the completion, "
                               "1 = off (default: 1.0)")
    generate.add_argument("--min-new-tokens", type=_non_negative_int, default=0, metavar="N",
                          help="no eos before N new tokens (default: 0)")
    generate.add_argument("--stop", action="append", default=None, metavar="TEXT", type=_stop_string,
                          help="stop string: a completion ends after the token that completes it (repeat for "
                               "several)")
    _add_input_options(generate, "prompts")
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    generate.add_argument("--no-stream", action="store_true",
                          help="print each completion when it is done; text output otherwise streams to the "
                               "terminal as rounds commit tokens whenever a batch holds one prompt (one --prompt, or "
                               "--batch-size 1)")

    evaluate = _subcommand(
        commands, "evaluate", command_evaluate,
        help="per-task fairness report (acceptance, speed-up, cross-entropy, U)",
        description="Measure how unequally the drafter accelerates each task; writes markdown, JSON and a PNG.",
        epilog="examples:\n  specdec evaluate --verifier ./big --drafter ./small --tasks tasks.jsonl "
               "--output-dir report/\n  specdec evaluate --verifier ./big --drafter ./small --tasks mgsm "
               "--task-names en,de,bn --max-examples 32 --cost-ratio 0.1\n\n"
               "Warnings name each task whose text the tokenizer turns into many unknown tokens, or whose texts are "
               "cut at the models' positions.")
    _add_model_options(evaluate)
    evaluate.add_argument("--tasks", type=_task_source, required=True, help=_tasks_help())
    evaluate.add_argument("--task-names", type=_name_list, default=None, metavar="NAMES", help=_TASK_NAMES_HELP)
    evaluate.add_argument("--max-examples", type=_positive_int, default=None,
                          help="the first N examples of every task (default: all)")
    evaluate.add_argument("--max-length", type=_positive_int, default=None,
                          help=f"tokens per reference text for the teacher-forced metrics; longer texts are cut, "
                               f"with a warning (default: {DEFAULT_MAX_LENGTH}, or the models' positions if fewer)")
    _add_decoding_options(evaluate, temperature=1.0, max_new_tokens=32)
    evaluate.add_argument("--cost-ratio", type=_non_negative_float, default=None,
                          help="c = drafter step time / verifier step time for the predicted speed-ups (default: "
                               "measured on specdec.generate's decoding step, reported with its spread)")
    evaluate.add_argument("--no-wall-clock", dest="wall_clock", action="store_false",
                          help="skip the measured wall-clock speed-up (specdec.generate against the verifier's own "
                               "generate on the same prompts; costs repeats + 1 more generation passes of each)")
    evaluate.add_argument("--wall-clock-repeats", type=_positive_int, default=3, metavar="N",
                          help="timed repetitions of the wall-clock measurement (default: 3)")
    evaluate.add_argument("--wall-clock-baseline", choices=("hf", "specdec"), default="hf",
                          help="plain decoding to time against: the verifier's own generate (hf, default) or "
                               "specdec.generate with no drafts on the same path (specdec: speculation's own speed-up)")
    evaluate.add_argument("--output-dir", type=Path, default=None,
                          help="write report.md, report.json and report.png here")
    _add_input_options(evaluate, "texts")

    finetune = _subcommand(
        commands, "finetune", command_finetune, help="finetune the drafter with s-CDF or a baseline",
        description="Update only the drafter so the tasks it serves worst catch up; the verifier is frozen.",
        epilog="methods: scdf (corrective weights K_i - min K), exact_variance (K_i - mean K: lowers U by levelling "
               "down), uniform_kd (distillation on the pooled data), balanced (equal task sampling)\n\n"
               "example:\n  specdec finetune --verifier ./big --drafter ./small --tasks tasks.jsonl --steps 200 "
               "--output ./small-scdf")
    _add_model_options(finetune, finetuning=True)
    finetune.add_argument("--tasks", type=_task_source, required=True, help="training texts: " + _tasks_help())
    finetune.add_argument("--task-names", type=_name_list, default=None, metavar="NAMES",
                          help=_TASK_NAMES_HELP + "; applies to --eval-tasks too")
    finetune.add_argument("--eval-tasks", type=_task_source, default=None,
                          help="texts for the U evaluations, in the formats of --tasks (default: hold out a seeded "
                               "share of every task's --tasks texts, see --eval-fraction; they are not trained on)")
    finetune.add_argument("--eval-fraction", type=_fraction, default=0.1,
                          help="without --eval-tasks, the share of every task's texts held out for the evaluations "
                               "(at most --eval-examples of them); 0 evaluates on training texts (default: 0.1)")
    finetune.add_argument("--eval-examples", type=_positive_int, default=32,
                          help="the most texts per task held out and evaluated (default: 32)")
    finetune.add_argument("--split-seed", type=_seed, default=0,
                          help="seed of the held-out split, apart from --seed so that training seeds share one "
                               "evaluation set (default: 0)")
    finetune.add_argument("--output", type=Path, required=True, help="folder to save the finetuned drafter into")
    finetune.add_argument("--overwrite", action="store_true", help="allow a non-empty --output folder")
    finetune.add_argument("--method", default="scdf", choices=("scdf", "exact_variance", "uniform_kd", "balanced"),
                          help="training objective, see the methods below (default: scdf)")
    finetune.add_argument("--weight-basis", default="ce", choices=("ce", "kl", "tv"),
                          help="per-task value the weights are computed on (default: ce)")
    finetune.add_argument("--per-character", action="store_true",
                          help="s-CDF on per-character figures: weights on D_i / rho_i (rho_i = characters per token "
                               "of task i), objective sum_i w_i K_i / rho_i (scdf and exact_variance; default: off)")
    finetune.add_argument("--mixture-weight", type=_non_negative_float, default=0.0, metavar="BETA",
                          help="in [0, 1]: keep this share of uniform distillation on the natural mixture in the "
                               "scdf / exact_variance loss, beta * sum_i pi_i K_i + (1 - beta) * sum_i w_i K_i with "
                               "pi_i the task's share of the training tokens and the w_i normalised to sum 1 "
                               "(default: 0.0, the method alone)")
    finetune.add_argument("--weight-floor", type=_non_negative_float, default=0.0,
                          help="added to every s-CDF task weight, so the best task keeps some weight (default: 0.0)")
    finetune.add_argument("--steps", type=_non_negative_int, default=200, help="optimizer steps (default: 200)")
    finetune.add_argument("--batch-size-per-task", type=_positive_int, default=8,
                          help="text windows per task in every step (default: 8)")
    finetune.add_argument("--seq-len", type=_int_at_least(2), default=64,
                          help="tokens per window; longer texts are cropped at a random offset, and it must not "
                               "exceed the models' positions (default: 64)")
    finetune.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate (default: 0.001)")
    finetune.add_argument("--eval-every", type=_positive_int, default=50,
                          help="steps between evaluations; one runs at the start and at the end too (default: 50)")
    finetune.add_argument("--checkpoint-dir", type=Path, default=None,
                          help="write a checkpoint here every --eval-every steps and on Ctrl-C, and resume from it "
                               "(default: OUTPUT.checkpoint beside --output, removed once the drafter is saved)")
    finetune.add_argument("--no-resume", action="store_true",
                          help="start afresh even if the checkpoint folder holds a checkpoint")
    finetune.add_argument("--max-examples", type=_positive_int, default=None,
                          help="the first N texts of every task (default: all)")
    finetune.add_argument("--seed", type=_seed, default=0,
                          help="seed of the minibatch sampling (default: 0)")
    _add_input_options(finetune, "texts")

    from specdec.cli.bench import add_bench_parser

    add_bench_parser(commands, _existing_path)

    demo = _subcommand(
        commands, "demo", command_demo, help="the offline demo: a built-in pair, its disparity, and s-CDF",
        description="Train (first run, ~2-3 min on 2 CPU cores) or load a small verifier/drafter pair, print the "
                    "per-task fairness table, finetune the drafter with s-CDF (and, with --baselines, the "
                    "baselines), print the table after, and write report.md and PNG plots.",
        epilog="The pair is cached under $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec.\n"
               "The report goes to ./specdec-demo-report (moved to the cache folder when run inside the specdec "
               "source tree).")
    demo.add_argument("--output-dir", type=Path, default=None, help="report folder (default: ./specdec-demo-report)")
    demo.add_argument("--cache-dir", type=Path, default=None, help="where the trained pair is cached")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the data and training (default: 0)")
    demo.add_argument("--baselines", action="store_true",
                      help="also finetune with uniform distillation, data balancing and exact-variance weights "
                           "(about a minute more)")
    demo.add_argument("--retrain", action="store_true", help="train the pair again even if it is cached")
    demo.add_argument("--finetune-steps", type=_positive_int, default=None, help="s-CDF steps (default: 150)")
    demo.add_argument("--cost-ratio", type=_non_negative_float, default=None,
                      help="c for the predicted speed-ups (default: measured on this machine)")
    demo.add_argument("--threads", type=_positive_int, default=1,
                      help="torch CPU threads; more threads than idle cores slow the tiny models down many times "
                           "over (default: 1)")
    demo.add_argument("--no-wall-clock", dest="wall_clock", action="store_false",
                      help="skip the measured wall-clock speed-ups (saves about 10 s per drafter)")
    demo.add_argument("--quick", action="store_true", help="tiny models and steps, for smoke tests only")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _show_specdec_warnings(prog: str) -> None:
    """Inside ``warnings.catch_warnings()``: print every :class:`specdec.compat.SpecdecWarning` as one line on stderr,
    ``<prog>: warning: <message>``, each time it is raised; other warnings as Python shows them."""
    from specdec.compat import SpecdecWarning

    warnings.simplefilter("always", SpecdecWarning)
    show = warnings.showwarning

    def show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                     line: str | None = None) -> None:
        if issubclass(category, SpecdecWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_warning


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specdec`` command; returns the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network, whatever the arguments
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after "--" goes to the benchmark scripts untouched
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1:]
    try:
        args = parser.parse_args(argv)
        if passthrough and args.command != "bench":
            parser.error(f"arguments after -- are only accepted by 'bench', got {' '.join(passthrough)}")
    except SystemExit as exit_request:  # --help, --version, or an argparse usage error (2)
        return int(exit_request.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if passthrough:
        args.script_args = passthrough
    args.argv = argv  # e.g. for the command that resumes an interrupted finetune
    subparser_prog = f"{PROGRAM} {args.command}"
    try:
        with warnings.catch_warnings(), _torch_threads(args):
            _show_specdec_warnings(subparser_prog)
            return int(args.handler(args) or 0)
    except UsageError as error:
        print(f"{subparser_prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{subparser_prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # every other failure: one line on stderr, traceback only on request
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        from specdec.cli.demo import DemoError

        if isinstance(error, DemoError):
            print(f"{subparser_prog}: error: {error}", file=sys.stderr)
            return 2
        if isinstance(error, CommandError):
            message = str(error)
        elif isinstance(error, (ValueError, TypeError, OSError)):
            message = f"{error}"
        else:
            message = f"{type(error).__name__}: {error} (set SPECDEC_DEBUG=1 to see the traceback)"
        print(f"{subparser_prog}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
