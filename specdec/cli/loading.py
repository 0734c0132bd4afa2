"""Loading what a ``specdec`` command needs: models, tokenizers and task files, offline and checked.

Models are Hugging Face model ids or local folders, loaded with ``local_files_only=True``. The two models' tokenizers
are compared where their folders have one, and output sizes that differ must be explained (``--vocab-size``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")


class UsageError(Exception):
    """A problem with the command line itself (exit code 2)."""


class CommandError(Exception):
    """A problem found while running a command (exit code 1)."""


def _looks_like_path(name: str) -> bool:
    """A local folder (existing, or written like a path) rather than a Hugging Face model id."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def _resolve_dtype(name: str, device: Any) -> Any:
    import torch

    if name == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    return getattr(torch, name)


def _resolve_device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"argument --device: not a torch device: {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {name}: no CUDA device is available on this machine (use --device cpu)")
    return device


def _load_failure(what: str, name: str, error: Exception) -> CommandError:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    hint = ("" if _looks_like_path(name) else
            " (models are loaded offline: pass a local folder written by save_pretrained, or an id already in the "
            "Hugging Face cache)")
    return CommandError(f"could not load the {what} {name!r}: {first_line}{hint}")


def load_tokenizer(name: str) -> Any:
    """A tokenizer loaded offline; left padding, and a pad token (eos when it has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as error:  # transformers raises many kinds (OSError, ValueError, ...)
        raise _load_failure("tokenizer", name, error) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name: str, what: str, device: Any, dtype_name: str) -> Any:
    """A causal LM loaded offline onto ``device`` in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no "Loading weights" bars around the command's own output
    try:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True,
                                                     dtype=_resolve_dtype(dtype_name, device))
    except Exception as error:  # transformers raises many kinds (OSError, ValueError, ...)
        raise _load_failure(what, name, error) from None
    return model.to(device).eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")
"""Files whose presence says a model folder (or a cached model id) comes with its own tokenizer."""


def _has_tokenizer(name: str) -> bool:
    """Whether the folder or cached model id ``name`` holds tokenizer files (nothing is downloaded)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return any((path / file).is_file() for file in TOKENIZER_FILES)
    if _looks_like_path(name):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(name, file), str) for file in TOKENIZER_FILES)
    except Exception:  # not a valid id, no cache: nothing to compare
        return False


TOKENIZER_ADVICE = {
    "verifier": "The verifier reads and writes the token ids of the tokenizer in use, so that must be the verifier's "
                "own tokenizer: leave out --tokenizer, or pass one that matches the verifier's tokenizer",
    "drafter": "Speculative decoding compares the two models token id by token id, so both must use one tokenizer: "
               "use a drafter trained with the verifier's tokenizer",
}
"""What to do when the tokenizer in use differs from a model's own, by the model's role."""


def _check_tokenizers(args: argparse.Namespace, tokenizer: Any) -> bool:
    """CommandError when the verifier's or the drafter's own tokenizer (where its folder has one) differs from the
    tokenizer in use; returns whether both models' tokenizers are known to match it."""
    from specdec.compat import SpecdecWarning, tokenizer_difference

    used = args.tokenizer or args.verifier
    matched = {"verifier": args.tokenizer is None, "drafter": args.drafter is None}  # (a self-drafter's is its own)
    for role, name in (("verifier", args.verifier), ("drafter", args.drafter)):
        if matched[role] or not _has_tokenizer(name):
            continue
        try:
            own = load_tokenizer(name)
        except CommandError as error:
            warnings.warn(f"the {role}'s tokenizer in {name} could not be loaded, so it was not compared with the "
                          f"tokenizer in use ({used}): {error}", SpecdecWarning, stacklevel=2)
            continue
        own_name, used_name = f"the {role}'s tokenizer ({name})", f"the tokenizer in use ({used})"
        difference = tokenizer_difference(tokenizer, own, used_name, own_name)
        if difference is not None:
            option = "--tokenizer" if role == "verifier" else "--drafter"
            unchecked = args.tokenizer is not None and not matched["verifier"]  # --tokenizer may not be the verifier's
            also = " (or, if --tokenizer is not the verifier's tokenizer, pass the verifier's)" if unchecked else ""
            raise CommandError(f"{option}: {own_name} differs from {used_name}: {difference}. "
                               f"{TOKENIZER_ADVICE[role]}{also}")
        matched[role] = True
    return matched["verifier"] and matched["drafter"]


def load_pair(args: argparse.Namespace) -> tuple[Any, Any, Any, int | None]:
    """The verifier, the drafter, the tokenizer and the id range they share (None: every id), after checking that
    the models' tokenizers match and that differing output sizes are accounted for."""
    from specdec.compat import resolve_vocab_size

    for what, name in (("verifier", args.verifier), ("drafter", args.drafter), ("tokenizer", args.tokenizer)):
        if name is not None and _looks_like_path(name) and not Path(name).expanduser().exists():
            raise UsageError(f"argument --{what}: no such folder: {name}")
    device = _resolve_device(args.device)
    tokenizer = load_tokenizer(args.tokenizer or args.verifier)
    same_tokenizer = _check_tokenizers(args, tokenizer)
    verifier = load_causal_lm(args.verifier, "verifier", device, args.dtype)
    if args.drafter is None:
        from specdec.decoding.self_drafter import layer_skip_drafter

        try:
            drafter = layer_skip_drafter(verifier, args.self_drafter, share_weights=not args.self_drafter_copy)
        except (TypeError, ValueError) as error:
            raise UsageError(f"argument --self-drafter: {error}") from None
    else:
        drafter = load_causal_lm(args.drafter, "drafter", device, args.dtype)
    try:
        vocab_size = resolve_vocab_size(verifier, drafter, args.vocab_size, tokenizer=tokenizer,
                                        same_tokenizer=same_tokenizer, option="--vocab-size")
    except ValueError as error:
        raise UsageError(f"argument --vocab-size: {error}") from None
    return verifier, drafter, tokenizer, vocab_size


def check_output_folder(path: Path, option: str) -> None:
    """UsageError before any work when ``path`` cannot become a folder we write into."""
    from specdec._validation import folder_problem

    problem = folder_problem(path)
    if problem:
        raise UsageError(f"argument {option}: {problem}")


def load_task_source(source: Path | str, max_examples: int | None,
                     names: list[str] | None = None) -> dict[str, Any]:
    """Tasks of a file, a folder or a built-in data set (``--tasks``), restricted to ``names`` (``--task-names``)."""
    from specdec.data import TaskFileError, UnknownTaskError, load_tasks

    try:
        return load_tasks(source, max_examples=max_examples, names=names)
    except UnknownTaskError as error:
        raise UsageError(f"argument --task-names: {error}") from None
    except TaskFileError as error:
        raise CommandError(str(error)) from None


def idle_cpus(interval: float = 0.1) -> float | None:
    """How many of the CPUs this process may run on were idle over the next ``interval`` seconds (idle and iowait
    time over all time, summed over those CPUs, from ``/proc/stat``); None where that cannot be read (not Linux)."""

    def sample(allowed: set[int]) -> dict[int, tuple[int, int]]:
        times = {}
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
                    ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                    times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
        return times

    try:
        allowed = os.sched_getaffinity(0)
        before = sample(allowed)
        time.sleep(interval)
        after = sample(allowed)
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu in before.keys() & after.keys():
        total = after[cpu][1] - before[cpu][1]
        if total > 0:
            idle += (after[cpu][0] - before[cpu][0]) / total
    return idle if before else None


def default_threads() -> int:
    """torch CPU threads for a command run without ``--threads``: the CPUs found idle (:func:`idle_cpus`, rounded,
    at least 1), at most torch's own default (its current thread count); torch's default where idleness is unknown.
    More threads than idle cores make torch's threads wait on each other (a command next to one busy process ran
    about 20 times slower)."""
    import torch

    limit = torch.get_num_threads()
    idle = idle_cpus()
    return limit if idle is None else max(1, min(limit, int(idle + 0.5)))
