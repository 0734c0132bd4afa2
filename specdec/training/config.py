"""The settings of :func:`specdec.training.finetune.finetune_drafter`: :class:`FinetuneConfig`, checked when made,
and the methods and weight bases it accepts."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdec._validation import check_backend, check_int_at_least, check_int_range, check_number

__all__ = ["METHODS", "MIXTURE_METHODS", "PER_CHARACTER_METHODS", "SETTINGS", "WEIGHT_BASES", "FinetuneConfig",
           "check_method_tasks", "resolve_config", "zero_weight_formula"]

METHODS = ("scdf", "exact_variance", "uniform_kd", "balanced")
WEIGHT_BASES = ("ce", "kl", "tv")
PER_CHARACTER_METHODS = ("scdf", "exact_variance")
MIXTURE_METHODS = ("scdf", "exact_variance")
"""The methods whose corrective term ``mixture_weight`` can mix with uniform distillation."""


@dataclass(frozen=True)
class FinetuneConfig:
    """The training settings of :func:`finetune_drafter` (frozen; derive a variant with :meth:`replace`).

    Every field is checked when the config is made: a bad value raises ValueError (TypeError for a non-number where a
    number is expected) naming the field.

    Attributes:
        method (str, default ``"scdf"``): ``"scdf"`` | ``"exact_variance"`` | ``"uniform_kd"`` | ``"balanced"``
            (see :mod:`specdec.training.finetune`).
        weight_basis (str, default ``"ce"``): ``"ce"`` | ``"kl"`` | ``"tv"``, the per-task values the s-CDF and
            exact-variance weights are computed on.
        weight_floor (float, default 0.0): >= 0, added to the corrective weights (``method="scdf"``).
        normalize_weights (bool, default False): divide the per-task weights by ``sum |w_i|``.
        steps (int, default 200): >= 0, total optimizer steps (a resumed run continues up to this number).
        batch_size_per_task (int, default 8): >= 1, windows per task per step (global, over all processes);
            ``uniform_kd`` draws ``batch_size_per_task * m`` windows from the pooled texts.
        seq_len (int, default 64): >= 2, window length in tokens (longer texts are cropped at a random offset).
        lr (float, default 1e-3): > 0, AdamW learning rate.
        weight_decay (float, default 0.0): >= 0, AdamW weight decay.
        max_grad_norm (float | None, default 1.0): > 0, gradient-norm clipping; None turns clipping off.
        temperature (float, default 1.0): > 0, applied to both p and q.
        eval_every (int | None, default 50): >= 1, evaluate U, alpha etc. on the evaluation set every this many
            steps (and always at the start and the end); None evaluates only at the start and the end.
        eval_fraction (float, default 0.1): in [0, 1), the share of every task's texts held out for the evaluations
            when no ``eval_tasks`` are given: ``ceil(eval_fraction * n)`` of a task's n texts, at most
            ``eval_examples``, chosen by a seeded shuffle (``split_seed``), are evaluated on (cropped to ``seq_len``)
            and never trained on. 0 evaluates on the first ``eval_examples`` training texts instead.
        eval_examples (int, default 32): >= 1, the most texts per task held out and evaluated when no
            ``eval_tasks`` are given.
        split_seed (int, default 0): in [0, 2**64), seeds the held-out split; kept apart from ``seed`` so runs with
            different training seeds evaluate on the same texts.
        checkpoint_dir (str | os.PathLike | None, default None): folder of ``drafter_checkpoint.safetensors``;
            None writes no checkpoint.
        checkpoint_every (int | None, default None): >= 1, steps between checkpoints (None: ``eval_every``); one
            is always written at the end.
        resume (bool, default True): continue from the checkpoint in ``checkpoint_dir`` when there is one (a
            corrupt one raises :class:`CheckpointError` instead of being overwritten); False starts afresh and
            replaces it at the first save.
        seed (int, default 0): in [0, 2**64), seeds the minibatch sampler.
        backend (str, default ``"auto"``): ``"auto"`` | ``"triton"`` | ``"torch"``, the divergence kernels.
        autocast (bool | None, default None): bf16 autocast of the training steps' forward passes, the output
            heads kept in float32 (float32 logits [N, V] for the weights and the loss: twice the memory of bf16
            ones); the evaluations always run in float32. None turns it on on CUDA only.
        per_character (bool, default False): take the corrective (or exact-variance) weights on per-character values
            ``v_i / rho_i`` and minimise ``sum_i w_i K_i / rho_i``, with ``rho_i`` the characters per token of task i
            (see this module's docstring); needs ``method`` ``"scdf"`` or ``"exact_variance"``, and string texts with
            a tokenizer (or token-id lists with a tokenizer to decode them, or ``chars_per_token=``).
            ``weight_floor`` is added to the per-character weights as to the per-token ones.
        mixture_weight (float, default 0.0): ``beta`` in [0, 1], the share of uniform distillation (the natural data
            mixture) in the loss of ``method`` ``"scdf"`` or ``"exact_variance"``:
            ``L = beta * sum_i pi_i K_i + (1 - beta) * sum_i w_i K_i`` (per character ``w_i K_i / rho_i``), with
            ``pi_i`` [m] task i's share of the training tokens (the share of tokens uniform KD's pooled draws give
            it: ``sum_j (min(len_j, seq_len) - 1)`` over its training texts, over that sum for all tasks) and
            ``w_i`` [m] the corrective weights normalised to ``sum_i |w_i| = 1``. Both terms are then weighted means
            of the same per-task minibatch losses ``K_i`` (no extra model call): ``beta = 1`` is uniform KD's
            expected loss, ``beta = 0`` the method alone. Above 0 it needs ``normalize_weights=True`` (so the two
            terms have one scale) and is refused with ``"uniform_kd"`` and ``"balanced"``, which have no corrective
            term.
    """

    method: str = "scdf"
    weight_basis: str = "ce"
    weight_floor: float = 0.0
    normalize_weights: bool = False
    steps: int = 200
    batch_size_per_task: int = 8
    seq_len: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    eval_every: int | None = 50
    eval_fraction: float = 0.1
    eval_examples: int = 32
    split_seed: int = 0
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    resume: bool = True
    seed: int = 0
    backend: str = "auto"
    autocast: bool | None = None
    per_character: bool = False
    mixture_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.per_character, bool):
            raise TypeError(f"per_character must be True or False, got {self.per_character!r}")
        if self.per_character and self.method not in PER_CHARACTER_METHODS:
            raise ValueError(f"per_character=True reweights the tasks of method 'scdf' or 'exact_variance'; method "
                             f"{self.method!r} has no per-task weights to take per character")
        if self.weight_basis not in WEIGHT_BASES:
            raise ValueError(f"weight_basis must be one of {WEIGHT_BASES}, got {self.weight_basis!r}")
        for name, minimum in (("steps", 0), ("batch_size_per_task", 1), ("seq_len", 2), ("eval_examples", 1)):
            check_int_at_least(getattr(self, name), name, minimum)
        for name in ("eval_every", "checkpoint_every"):
            check_int_at_least(getattr(self, name), name, 1, allow_none=True)
        numbers = {"weight_floor": check_number(self.weight_floor, "weight_floor", 0.0),
                   "lr": check_number(self.lr, "lr", 0.0, strict=True),
                   "weight_decay": check_number(self.weight_decay, "weight_decay", 0.0),
                   "temperature": check_number(self.temperature, "temperature", 0.0, strict=True),
                   "eval_fraction": check_number(self.eval_fraction, "eval_fraction", 0.0)}
        numbers["mixture_weight"] = _check_mixture_weight(self.mixture_weight, self.method, self.normalize_weights)
        if numbers["eval_fraction"] >= 1:
            raise ValueError(f"eval_fraction must be in [0, 1) (the share of each task's texts held out), got "
                             f"{self.eval_fraction}")
        if self.max_grad_norm is not None:
            numbers["max_grad_norm"] = check_number(self.max_grad_norm, "max_grad_norm", 0.0, strict=True)
        for name, value in numbers.items():  # ints given for floats are kept as floats (the checkpoint compares them)
            object.__setattr__(self, name, value)
        check_int_range(self.seed, "seed", 0, 2**64)
        check_int_range(self.split_seed, "split_seed", 0, 2**64)
        check_backend(self.backend)

    def replace(self, **changes: Any) -> FinetuneConfig:
        """A copy with ``changes`` applied (and checked); an unknown name raises TypeError naming it."""
        return dataclasses.replace(self, **_known_settings(changes, "FinetuneConfig.replace()"))


SETTINGS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))


def _check_mixture_weight(value: object, method: str, normalize_weights: bool) -> float:
    """``mixture_weight`` as a float in [0, 1] that ``method`` and ``normalize_weights`` allow, else TypeError /
    ValueError naming it."""
    beta = check_number(value, "mixture_weight", 0.0)
    if beta > 1:
        raise ValueError(f"mixture_weight must be in [0, 1] (the share of uniform distillation in the loss), got "
                         f"{value}")
    if beta > 0 and method not in MIXTURE_METHODS:
        raise ValueError(f"mixture_weight={value} mixes uniform distillation into the corrective loss of method "
                         f"'scdf' or 'exact_variance'; method {method!r} has no corrective term (use "
                         f"mixture_weight=0)")
    if beta > 0 and normalize_weights is not True:
        raise ValueError(f"mixture_weight={value} needs normalize_weights=True: the corrective weights are then "
                         "normalised to sum |w_i| = 1, the scale of the token shares they are mixed with")
    return beta


def _known_settings(settings: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """``settings`` when every name is a :class:`FinetuneConfig` field, else TypeError naming the first unknown one."""
    for name in settings:
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, SETTINGS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(SETTINGS)}"
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
    return dict(settings)


def resolve_config(config: FinetuneConfig | None, settings: Mapping[str, Any]) -> FinetuneConfig:
    """The config of one :func:`finetune_drafter` call: ``config``, or one built from the setting keywords.

    Raises TypeError naming the keywords when both are given (the settings belong in one place), an unknown keyword,
    or a ``config`` that is not a :class:`FinetuneConfig`.
    """
    settings = _known_settings(settings, "finetune_drafter()")
    if config is None:
        return FinetuneConfig(**settings)
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig or None, got {type(config).__name__}")
    if settings:
        names = ", ".join(sorted(settings))
        raise TypeError(f"finetune_drafter() got config= and the setting keyword(s) {names}: give the settings in "
                        f"one place, e.g. config=config.replace({sorted(settings)[0]}=...)")
    return config


def zero_weight_formula(config: FinetuneConfig, num_tasks: int) -> str | None:
    """The per-task weight of ``config``'s method when it is 0 for every one of ``num_tasks`` tasks, so that the
    method would train nothing and save the drafter unchanged, else None: with one task (and ``mixture_weight`` 0),
    the s-CDF weight ``K_i - min_j K_j`` (without a ``weight_floor``) and the exact-variance weight
    ``K_i - mean_j K_j``."""
    if num_tasks != 1 or config.mixture_weight > 0:  # the uniform-distillation term trains one task too
        return None
    if config.method == "scdf" and config.weight_floor == 0:
        return "K_i - min_j K_j"
    if config.method == "exact_variance":
        return "K_i - mean_j K_j"
    return None


def check_method_tasks(config: FinetuneConfig, task_names: list[str]) -> None:
    """ValueError naming the alternatives when ``config``'s method would train nothing on these tasks
    (:func:`zero_weight_formula`)."""
    formula = zero_weight_formula(config, len(task_names))
    if formula is None:
        return
    floor = ", or weight_floor > 0 (the floor becomes its weight)" if config.method == "scdf" else ""
    raise ValueError(f"method {config.method!r} needs at least 2 tasks: with the one task {task_names[0]!r} its "
                     f"weight {formula} is 0 and the drafter would not change. Give more tasks, use method "
                     f"'uniform_kd' or 'balanced' (distillation on the one task), or mixture_weight > 0{floor}")
