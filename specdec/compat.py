"""Checks that data, tokenizers and models fit each other, so that a mismatch gives a warning or an error instead of
figures that look fine and mean nothing.

* :func:`check_task_texts`: per task, the share of tokens that are the tokenizer's unknown token (a tokenizer that
  does not cover the language or script), texts longer than the models' positions or another length limit (cut off the
  metrics) and prompts that leave no room for the new tokens; a :class:`SpecdecWarning` names the task and the figure.
* :func:`check_same_tokenizer`: ValueError when the drafter's tokenizer and the verifier's map ids to different
  tokens (speculative decoding compares the two models id by id).
* :func:`resolve_vocab_size`: the id range the pair shares; ValueError when the output layers differ in size and
  nothing says whether the extra rows are padding of one vocabulary or another vocabulary.
* :func:`model_positions`: a model's ``max_position_embeddings`` (or its equivalent).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec._models import model_vocab_size
from specdec._validation import check_int_at_least, check_int_range

__all__ = [
    "UNKNOWN_TOKEN_THRESHOLD",
    "SpecdecWarning",
    "TextCheck",
    "check_same_tokenizer",
    "check_task_texts",
    "model_positions",
    "pair_positions",
    "resolve_vocab_size",
    "shared_vocab_size",
    "special_token_ids",
    "tokenizer_difference",
]

UNKNOWN_TOKEN_THRESHOLD = 0.05
"""Default share of unknown tokens in a task above which :func:`check_task_texts` warns."""

_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class SpecdecWarning(UserWarning):
    """The data, the tokenizer or the models do not fit each other well enough for the figures to be trusted as they
    are (e.g. a tokenizer that turns most of a language into unknown tokens, or texts cut at the models' positions).
    The message names the task and the figure."""


def _warn(message: str) -> None:
    """A :class:`SpecdecWarning` attributed to the caller of :func:`check_task_texts` (through ``_warn_about``)."""
    warnings.warn(message, SpecdecWarning, stacklevel=4)


# ----------------------------------------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------------------------------------


def model_positions(model: Any) -> int | None:
    """The number of positions ``model`` was built for (``config.max_position_embeddings``, or ``n_positions`` etc.
    for the architectures that name it so); None when its config gives none."""
    config = getattr(model, "config", None)
    for name in _POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def pair_positions(verifier: Any, drafter: Any) -> int | None:
    """The positions both models have: the smaller of their :func:`model_positions` (None when neither gives one)."""
    known = [p for p in (model_positions(verifier), model_positions(drafter)) if p is not None]
    return min(known) if known else None


# ----------------------------------------------------------------------------------------------------------------------
# Task texts: unknown tokens, truncation, prompts that leave no room
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TextCheck:
    """What :func:`check_task_texts` found in one task.

    ``num_tokens`` counts the texts' and prompts' tokens (special tokens left out), ``unknown_tokens`` how many of
    them are the tokenizer's unknown token; ``texts_cut`` texts are longer than ``limit`` tokens and lose
    ``tokens_cut`` of their ``text_tokens`` tokens; ``prompts_too_long`` prompts leave fewer than ``max_new_tokens``
    of the models' positions.
    """

    name: str
    num_texts: int = 0
    num_prompts: int = 0
    num_tokens: int = 0  # texts and prompts together
    unknown_tokens: int = 0  # of num_tokens
    text_tokens: int = 0  # texts only
    texts_cut: int = 0  # texts longer than limit
    tokens_cut: int = 0  # of text_tokens, past limit
    prompts_too_long: int = 0
    limit: int | None = None  # tokens kept per text (None: no limit)

    @property
    def unknown_rate(self) -> float:
        """The share of the task's tokens that are the unknown token (0 for a task without tokens)."""
        return self.unknown_tokens / self.num_tokens if self.num_tokens else 0.0


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``tokenizer`` that stand for no text: its ``all_special_ids`` and its ``bos_token_id``,
    ``eos_token_id`` and ``pad_token_id`` where it has them, less the unknown token (which stands for text the
    tokenizer cannot spell). Empty for None or a tokenizer that names none."""
    if tokenizer is None:
        return frozenset()
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id"))
    unk = getattr(tokenizer, "unk_token_id", None)
    return frozenset(t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t != unk)


def _task_parts(name: str, value: Any) -> tuple[list[Any], list[Any]]:
    """``(texts, prompts)`` of one task given as TaskData-like object, a mapping, or a sequence of texts."""
    if isinstance(value, Mapping):
        texts, prompts = value.get("texts"), value.get("prompts")
    elif hasattr(value, "texts") or hasattr(value, "prompts"):
        texts, prompts = getattr(value, "texts", None), getattr(value, "prompts", None)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        texts, prompts = value, None
    else:
        raise TypeError(f"tasks[{name!r}] must be a TaskData, a mapping with 'texts'/'prompts', or a list of texts, "
                        f"got {type(value).__name__}")
    return list(texts or []), list(prompts or [])


def _encode(tokenizer: Any, items: list[Any], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of ``items`` (strings encoded in one batch call where the tokenizer allows; id lists kept)."""
    strings = [i for i, item in enumerate(items) if isinstance(item, str)]
    out: list[list[int]] = [list(item) if not isinstance(item, str) else [] for item in items]
    if not strings:
        return out
    texts = [items[i] for i in strings]
    try:
        encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception:  # not a Hugging Face tokenizer: one encode() per text
        encoded = [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]
    for index, ids in zip(strings, encoded, strict=True):
        out[index] = list(ids)
    return out


def check_task_texts(tasks: Mapping[str, Any], tokenizer: Any, *, max_positions: int | None = None,
                     max_length: int | None = None, max_new_tokens: int = 0,
                     unknown_threshold: float | None = UNKNOWN_TOKEN_THRESHOLD, add_special_tokens: bool = False,
                     warn: bool = True) -> dict[str, TextCheck]:
    """Check every task's texts and prompts against the tokenizer and the models' length limits.

    Args:
        tasks: name -> ``TaskData`` (``.texts``/``.prompts``), a mapping with ``"texts"``/``"prompts"``, or a list of
            texts. Strings are encoded with ``tokenizer``; token-id lists are taken as they are.
        tokenizer: a Hugging Face tokenizer (``unk_token_id``; without one no token counts as unknown).
        max_positions: the models' positions (:func:`pair_positions`); texts longer than this are cut, and prompts
            leaving fewer than ``max_new_tokens`` of them are reported.
        max_length: another cut on the texts' tokens (e.g. ``specdec.evaluate``'s ``max_length``); the smaller of the
            two limits applies.
        max_new_tokens: tokens each prompt is continued by.
        unknown_threshold: warn when more than this share of a task's tokens are unknown (None: never).
        add_special_tokens: encode as the evaluation does (BOS etc. count towards the length).
        warn: emit a :class:`SpecdecWarning` per task and problem (False: only return the figures).

    Returns:
        ``{task: TextCheck}``.
    """
    if not isinstance(tasks, Mapping):
        raise TypeError(f"tasks must be a mapping from task name to texts, got {type(tasks).__name__}")
    max_positions = check_int_at_least(max_positions, "max_positions", 1, allow_none=True)
    max_length = check_int_at_least(max_length, "max_length", 1, allow_none=True)
    max_new_tokens = check_int_at_least(max_new_tokens, "max_new_tokens", 0)
    unknown_threshold = _check_unknown_threshold(unknown_threshold)
    limits = [limit for limit in (max_positions, max_length) if limit is not None]
    limit = min(limits) if limits else None
    unk = getattr(tokenizer, "unk_token_id", None)
    special = special_token_ids(tokenizer)
    results: dict[str, TextCheck] = {}
    for name, value in tasks.items():
        texts, prompts = _task_parts(str(name), value)
        check = TextCheck(name=str(name), num_texts=len(texts), num_prompts=len(prompts), limit=limit)
        text_ids = _encode(tokenizer, texts, add_special_tokens)
        prompt_ids = _encode(tokenizer, prompts, add_special_tokens)
        for ids in text_ids + prompt_ids:
            check.num_tokens += sum(1 for t in ids if t not in special)
            if unk is not None:
                check.unknown_tokens += sum(1 for t in ids if t == unk)
        for ids in text_ids:
            check.text_tokens += len(ids)
            if limit is not None and len(ids) > limit:
                check.texts_cut += 1
                check.tokens_cut += len(ids) - limit
        if max_positions is not None:
            check.prompts_too_long = sum(1 for ids in prompt_ids if len(ids) + max_new_tokens > max_positions)
        results[check.name] = check
        if warn:
            _warn_about(check, tokenizer, unknown_threshold, max_positions, max_length, max_new_tokens)
    return results


def _check_unknown_threshold(value: object) -> float | None:
    """``value`` as a float in [0, 1), or None; TypeError for a non-number, ValueError otherwise, one message."""
    if value is None:
        return None
    problem = f"unknown_threshold must be a number in [0, 1) or None, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(problem)
    if not 0 <= value < 1:  # NaN fails too
        raise ValueError(problem)
    return float(value)


def _warn_about(check: TextCheck, tokenizer: Any, unknown_threshold: float | None, max_positions: int | None,
                max_length: int | None, max_new_tokens: int) -> None:
    if unknown_threshold is not None and check.num_tokens and check.unknown_rate > unknown_threshold:
        token = getattr(tokenizer, "unk_token", None) or "the unknown token"
        _warn(f"task {check.name!r}: {check.unknown_rate:.1%} of its {check.num_tokens:,} tokens are {token!r} "
              f"(more than {unknown_threshold:.0%}): the tokenizer does not cover this task's text, so its figures "
              "describe unknown tokens, not the text; use a tokenizer (and models) that cover its language and "
              "script")
    if check.texts_cut:
        if max_positions is not None and check.limit == max_positions:
            why = f"the models' {max_positions} positions (max_position_embeddings)"
        else:
            why = f"max_length={max_length}"
        _warn(f"task {check.name!r}: {check.texts_cut} of its {check.num_texts} texts are longer than {why}: "
              f"{check.tokens_cut:,} of their {check.text_tokens:,} tokens ({check.tokens_cut / check.text_tokens:.0%})"
              " are cut off and not measured")
    if check.prompts_too_long:
        _warn(f"task {check.name!r}: {check.prompts_too_long} of its {check.num_prompts} prompts leave fewer than "
              f"max_new_tokens={max_new_tokens} of the models' {max_positions} positions (max_position_embeddings): "
              "generation runs past the positions the models were built for; use shorter prompts or fewer new "
              "tokens")


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers and vocabularies
# ----------------------------------------------------------------------------------------------------------------------


def _vocab(tokenizer: Any, name: str) -> dict[str, int]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        raise TypeError(f"{name} must be a tokenizer with get_vocab(), got {type(tokenizer).__name__}")
    return dict(get_vocab())


def tokenizer_difference(first: Any, second: Any, first_name: str = "first",
                         second_name: str = "second") -> str | None:
    """None when the two tokenizers map the same tokens to the same ids, else a one-line description of how they
    differ (sizes, how many ids mean different tokens, the first such id)."""
    a, b = _vocab(first, first_name), _vocab(second, second_name)
    if a == b:
        return None
    by_id_a = {i: t for t, i in a.items()}
    by_id_b = {i: t for t, i in b.items()}
    shared = sorted(set(by_id_a) & set(by_id_b))
    changed = [i for i in shared if by_id_a[i] != by_id_b[i]]
    only_a, only_b = len(by_id_a) - len(shared), len(by_id_b) - len(shared)
    parts = [f"{first_name} has {len(a):,} tokens and {second_name} {len(b):,}"]
    if changed:
        i = changed[0]
        parts.append(f"{len(changed):,} of the ids both have map to different tokens (e.g. id {i}: {by_id_a[i]!r} "
                     f"against {by_id_b[i]!r})")
    for count, name in ((only_a, first_name), (only_b, second_name)):
        if count:
            parts.append(f"{count:,} ids exist only in {name}")
    return "; ".join(parts)


def check_same_tokenizer(verifier_tokenizer: Any, drafter_tokenizer: Any, *,
                         verifier_name: str = "the verifier's tokenizer",
                         drafter_name: str = "the drafter's tokenizer") -> None:
    """ValueError unless the two tokenizers have the same vocabulary (token -> id); the message calls them
    ``verifier_name`` and ``drafter_name``.

    Speculative decoding compares the drafter's and the verifier's distributions id by id, so a drafter trained with
    another tokenizer proposes tokens that mean something else to the verifier (almost none are accepted) and every
    per-task figure is meaningless.
    """
    difference = tokenizer_difference(verifier_tokenizer, drafter_tokenizer, verifier_name, drafter_name)
    if difference is not None:
        raise ValueError(f"{drafter_name} differs from {verifier_name}: {difference}. Speculative decoding compares "
                         "the two models token id by token id, so both must use one tokenizer: use a drafter "
                         "trained with the verifier's tokenizer")


def resolve_vocab_size(verifier: Any, drafter: Any, vocab_size: int | None = None, *, tokenizer: Any = None,
                       same_tokenizer: bool = False, option: str = "vocab_size") -> int | None:
    """The id range the two models share, or None when their output layers have the same size (every id is shared).

    With ``vocab_size`` given, it is checked (an int in ``[1, smaller output size]``) and returned. When the output
    sizes differ and ``vocab_size`` is None, the extra rows may be padding of one vocabulary (some model families
    round the vocabulary up) or another vocabulary altogether: with ``same_tokenizer=True`` (the caller compared the
    two models' tokenizers with :func:`check_same_tokenizer`) the tokenizer's size is returned; otherwise ValueError
    saying what to pass (``option`` names the argument in the message, e.g. ``"--vocab-size"``).
    """
    verifier_rows, drafter_rows = model_vocab_size(verifier, "verifier"), model_vocab_size(drafter, "drafter")
    smaller = min(verifier_rows, drafter_rows)
    if vocab_size is not None:
        return check_int_range(vocab_size, option, 1, smaller + 1,
                               note=f" (the models' output sizes are {verifier_rows} and {drafter_rows})")
    if verifier_rows == drafter_rows:
        return None
    tokens = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if same_tokenizer and tokens is not None and tokens <= smaller:
        return tokens
    suggestion = tokens if tokens is not None and tokens <= smaller else smaller
    value = f"{option} {suggestion}" if option.startswith("--") else f"{option}={suggestion}"
    where = f" (the tokenizer has {tokens:,} tokens)" if tokens is not None else ""
    raise ValueError(
        f"the drafter has {drafter_rows:,} output rows (token ids) and the verifier {verifier_rows:,}: either one "
        f"vocabulary padded to a larger size, or two different vocabularies, and nothing here tells which. If both "
        f"models use the same tokenizer, pass {value}{where} to compare only the ids they share; if the drafter was "
        "trained with another tokenizer, it cannot draft for this verifier")


def shared_vocab_size(verifier: Any, drafter: Any, vocab_size: int | None = None, *, tokenizer: Any = None) -> int:
    """The number of token ids both models take: :func:`resolve_vocab_size`'s value, or the output size the two
    models have in common (ValueError, as there, for output sizes that differ without ``vocab_size``)."""
    return (resolve_vocab_size(verifier, drafter, vocab_size, tokenizer=tokenizer)
            or model_vocab_size(verifier, "verifier"))
