"""s-CDF objective: per-task weights and the weighted distillation loss.

Notation. ``m`` tasks; ``K_i`` is task ``i``'s mean drafter cross-entropy against the verifier,
``K_i = E_{s~T_i} H(p(.|s), q(.|s))``, estimated on a minibatch of prefixes drawn from task ``i``. The unfairness is the
population variance ``U = (1/m) sum_i (K_i - Kbar)^2`` with ``Kbar = (1/m) sum_i K_i``, and

    grad U = (2/m) sum_i (K_i - Kbar) grad K_i.

s-CDF minimises ``sum_i w_i K_i`` with weights ``w_i`` computed from the (detached) per-task values:

* ``"scdf"`` (corrective, the default): ``w_i = K_i - min_j K_j + floor``. Non-negative; only tasks behind the best one
  are pulled toward the verifier, so U falls without pushing any task away from the verifier.
* ``"exact_variance"``: ``w_i = K_i - Kbar``, so ``grad sum_i w_i K_i = (m/2) grad U`` exactly. Weights of tasks ahead
  of the mean are negative: gradient descent moves those tasks *away* from the verifier (U falls by levelling down).
* ``"uniform"``: ``w_i = 1`` (equal-task distillation; the "balanced" baseline).

The weights may be computed on a different basis than the loss (``weight_basis`` in
:mod:`specdec.training.finetune`): on KL or TV instead of CE. Since ``H(p)`` does not depend on the drafter,
``grad K_i = grad D_i``, so the loss is always the cross-entropy ``K_i`` and only the weights change with the basis.

Per character (:func:`per_character_weights`, used by ``chars_per_token`` of :func:`scdf_loss` and ``per_character`` in
:mod:`specdec.training.finetune`): with
``rho_i`` the characters per token of task i, a round of speculative decoding yields ``rho_i`` times as many
characters as tokens, and the misfit a drafter can remove costs ``D_i / rho_i`` nats per character. The weights are
then taken on ``v_i / rho_i`` (``w_i = v_i / rho_i - min_j v_j / rho_j + floor``, or minus the mean) and the objective
is the per-character cross-entropy ``L = sum_i w_i K_i / rho_i``.

Mixed with the natural data mixture (``mixture_weight`` ``beta`` of :func:`scdf_loss` and of
:class:`specdec.training.config.FinetuneConfig`): corrective weights replace the mixture the drafter was trained on, so
the dominant task of that mixture may lose ground. The mixed objective keeps a share of uniform distillation,

    L = beta * sum_i pi_i K_i + (1 - beta) * sum_i w_i K_i,     sum_i pi_i = 1, sum_i |w_i| = 1,

with ``pi_i`` task i's share of the training tokens (uniform distillation on the pooled texts minimises
``sum_i pi_i K_i`` in expectation) and ``w_i`` the normalised corrective weights (per character ``w_i / rho_i`` in
place of ``w_i``). Both terms are weighted means of the same per-task losses, so ``beta = 1`` is uniform
distillation and ``beta = 0`` the corrective objective alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

WEIGHT_METHODS = ("scdf", "exact_variance", "uniform")


def _as_task_vector(values: torch.Tensor | Sequence[float], name: str, present: torch.Tensor | None = None,
                    like: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` as a 1-D float tensor [m]; a sequence of tensors is stacked (its graph kept), a sequence of numbers
    becomes a constant. Entries must be finite where ``present`` ([m] bool, default all) is True."""
    if isinstance(values, torch.Tensor):
        tensor = values
    elif isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        if values and all(isinstance(v, torch.Tensor) for v in values):
            if any(v.numel() != 1 for v in values):
                raise ValueError(f"{name}: a sequence of tensors must hold one value per task, got shapes "
                                 f"{[tuple(v.shape) for v in values]}")
            tensor = torch.stack([v.reshape(()) for v in values])  # keeps each task's graph
        else:
            try:
                tensor = torch.tensor([float(v) for v in values], dtype=torch.float32)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {values!r}") from exc
    else:
        raise TypeError(f"{name} must be a 1-D tensor [m] or a sequence of floats, got {type(values).__name__}")
    if tensor.dim() != 1 or tensor.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor [m] (one value per task), "
                         f"got shape {tuple(tensor.shape)}")
    if like is not None and tensor.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)} like task_losses, got {tuple(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        tensor = tensor.float()
    finite = torch.isfinite(tensor.detach())
    if present is not None:
        finite = finite | ~_check_present(present, tensor.shape[0]).to(finite.device)
    if not bool(finite.all()):
        raise ValueError(f"{name} must be finite{' for every present task' if present is not None else ''}, got "
                         f"{tensor.detach().tolist()} (per_task_mean gives NaN for a task with no tokens: pass "
                         f"present=counts > 0 to leave such tasks out)")
    return tensor


def _check_present(present: torch.Tensor | None, num_tasks: int) -> torch.Tensor | None:
    if present is None:
        return None
    if not isinstance(present, torch.Tensor) or present.dtype != torch.bool:
        raise TypeError(f"present must be a bool tensor [m], got "
                        f"{present.dtype if isinstance(present, torch.Tensor) else type(present).__name__}")
    if present.shape != (num_tasks,):
        raise ValueError(f"present must have shape [m] = ({num_tasks},), got {tuple(present.shape)}")
    if not bool(present.any()):
        raise ValueError("present must mark at least one task")
    return present


def _check_floor(floor: float) -> float:
    if isinstance(floor, bool) or not isinstance(floor, (int, float)):
        raise TypeError(f"floor must be a float, got {type(floor).__name__}")
    if not math.isfinite(floor) or floor < 0:
        raise ValueError(f"floor must be a finite number >= 0, got {floor}")
    return float(floor)


def scdf_weights(per_task_values: torch.Tensor | Sequence[float], method: str = "scdf", floor: float = 0.0,
                 normalize: bool = False, present: torch.Tensor | None = None) -> torch.Tensor:
    """Per-task weights of the s-CDF objective, detached from the graph.

    Args:
        per_task_values: [m] per-task values of the weight basis (CE ``K_i``, KL ``D_i`` or TV), any float dtype.
        method: ``"scdf"`` -> ``w_i = v_i - min_j v_j + floor``; ``"exact_variance"`` -> ``w_i = v_i - mean_j v_j``
            (so that ``sum_i w_i grad v_i = (m/2) grad U``); ``"uniform"`` -> ``w_i = 1``.
        floor: >= 0, added to the corrective weights so the best task keeps a small pull toward the verifier (used by
            ``"scdf"`` only).
        normalize: divide by ``sum_i |w_i|`` (when positive) so the loss scale does not shrink as the gaps close.
        present: optional [m] bool, the tasks seen in the minibatch (e.g. ``counts > 0``); the others get weight 0
            and are left out of the minimum / mean (their values may be NaN, as :func:`per_task_mean` gives them).
            Default: every task, and every value must be finite.

    Returns:
        [m] float32 tensor on the device of ``per_task_values``, ``requires_grad=False``.
    """
    if method not in WEIGHT_METHODS:
        raise ValueError(f"method must be one of {WEIGHT_METHODS}, got {method!r}")
    floor = _check_floor(floor)
    values = _as_task_vector(per_task_values, "per_task_values", present).detach().float()
    if present is not None:
        present = present.to(values.device)
        seen = values[present]
    else:
        seen = values
    if method == "scdf":
        weights = values - seen.min() + floor
    elif method == "exact_variance":
        weights = values - seen.mean()
    else:
        weights = torch.ones_like(values)
    if present is not None:
        weights = torch.where(present, weights, torch.zeros_like(weights))
    if normalize:
        total = weights.abs().sum()
        if float(total) > 0:
            weights = weights / total
    return weights


class CharacterWeights(NamedTuple):
    """Result of :func:`per_character_weights`, all detached and [m]: ``values`` the per-character values
    ``v_i / rho_i`` (float64), ``weights`` the ``w_i`` (float32), ``multipliers`` the ``w_i / rho_i`` (float32)."""

    values: torch.Tensor
    weights: torch.Tensor
    multipliers: torch.Tensor


def per_character_weights(per_task_values: torch.Tensor, chars_per_token: torch.Tensor, method: str = "scdf",
                          floor: float = 0.0, normalize: bool = False,
                          present: torch.Tensor | None = None) -> CharacterWeights:
    """The s-CDF weights taken per character: ``w = scdf_weights(v / rho)``, and the multipliers ``w_i / rho_i`` of
    ``K_i`` in the objective ``sum_i w_i K_i / rho_i``.

    Args:
        per_task_values: [m] values ``v_i`` of the weight basis. chars_per_token: [m] ``rho_i``, finite and > 0
            (ValueError otherwise). With ``rho_i = 1`` for every task the values, weights and multipliers are the
            per-token ones.
        method, floor, normalize, present: see :func:`scdf_weights`.
    """
    _check_chars_per_token(chars_per_token, per_task_values)
    return per_character_weights_unchecked(per_task_values, chars_per_token, method, floor, normalize, present)


def per_character_weights_unchecked(per_task_values: torch.Tensor, chars_per_token: torch.Tensor, method: str = "scdf",
                                    floor: float = 0.0, normalize: bool = False,
                                    present: torch.Tensor | None = None) -> CharacterWeights:
    """:func:`per_character_weights` without the check of ``chars_per_token`` (no device sync), for the finetuning
    step loop, whose ``rho`` is checked once before it."""
    rho = chars_per_token.detach().to(per_task_values.device, torch.float64)
    values = per_task_values.detach().double() / rho
    weights = scdf_weights(values, method=method, floor=floor, normalize=normalize, present=present)
    return CharacterWeights(values, weights, (weights.double() / rho).float())


def _check_chars_per_token(chars_per_token: torch.Tensor, per_task_values: torch.Tensor) -> None:
    """TypeError / ValueError naming ``chars_per_token`` unless it is a float tensor [m] shaped like the [m]
    ``per_task_values``, every entry finite and > 0 (one device sync)."""
    for name, tensor in (("per_task_values", per_task_values), ("chars_per_token", chars_per_token)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [m], got {type(tensor).__name__}")
    if per_task_values.dim() != 1:
        raise ValueError(f"per_task_values must have shape [m], got {tuple(per_task_values.shape)}")
    if chars_per_token.shape != per_task_values.shape:
        raise ValueError(f"chars_per_token must have shape [m] = {tuple(per_task_values.shape)} like per_task_values "
                         f"(one characters-per-token value per task), got {tuple(chars_per_token.shape)}")
    if not chars_per_token.dtype.is_floating_point:
        raise TypeError(f"chars_per_token must be a float tensor [m], got {chars_per_token.dtype}")
    rho = chars_per_token.detach()
    if not bool((torch.isfinite(rho) & (rho > 0)).all()):
        raise ValueError(f"chars_per_token must be > 0 and finite for every task (characters per token), got "
                         f"{rho.tolist()}")


def mix_multipliers_unchecked(multipliers: torch.Tensor, task_shares: torch.Tensor, mixture_weight: float,
                              present: torch.Tensor | None = None) -> torch.Tensor:
    """The [m] float32 multipliers of ``K_i`` in the mixed objective: ``beta * pi_i + (1 - beta) * multipliers_i``,
    with ``pi`` the [m] ``task_shares`` renormalised to sum 1 over the ``present`` tasks (absent ones get 0).
    ``mixture_weight`` (``beta``) 0 returns ``multipliers`` itself and 1 the shares alone, exactly. No checks (the
    finetuning step loop checks once before it)."""
    if mixture_weight == 0:
        return multipliers
    shares = task_shares.detach().to(multipliers.device, torch.float64)
    if present is not None:
        shares = torch.where(present.to(shares.device), shares, torch.zeros_like(shares))
    shares = shares / shares.sum()
    if mixture_weight == 1:
        return shares.float()
    return (mixture_weight * shares + (1 - mixture_weight) * multipliers.double()).float()


def _check_mixture(mixture_weight: float, task_shares: object, like: torch.Tensor, normalize: bool,
                   method: str) -> torch.Tensor | None:
    """The [m] ``task_shares`` (finite, >= 0, positive sum) when ``mixture_weight`` is in (0, 1], None when it is 0;
    TypeError / ValueError naming the argument otherwise."""
    if isinstance(mixture_weight, bool) or not isinstance(mixture_weight, (int, float)):
        raise TypeError(f"mixture_weight must be a float in [0, 1], got {type(mixture_weight).__name__}")
    if not 0 <= mixture_weight <= 1:
        raise ValueError(f"mixture_weight must be in [0, 1] (the share of the natural mixture), got {mixture_weight}")
    if mixture_weight == 0:
        return None
    if task_shares is None:
        raise ValueError("mixture_weight > 0 needs task_shares, the [m] share of the training tokens of every task")
    if method == "uniform":
        raise ValueError("mixture_weight > 0 mixes the natural mixture into a corrective objective: use method "
                         "'scdf' or 'exact_variance'")
    if not normalize:
        raise ValueError("mixture_weight > 0 needs normalize=True (the corrective weights then sum to 1 in absolute "
                         "value, as the task shares do)")
    shares = _as_task_vector(task_shares, "task_shares", like=like).detach()
    if not bool((shares >= 0).all()) or float(shares.sum()) <= 0:
        raise ValueError(f"task_shares must be >= 0 with a positive sum, got {shares.tolist()}")
    return shares


class ScdfLoss(NamedTuple):
    """Result of :func:`scdf_loss`: ``loss`` (0-dim, differentiable) and the detached ``weights`` [m] float32."""

    loss: torch.Tensor
    weights: torch.Tensor


def scdf_loss(task_losses: torch.Tensor | Sequence[torch.Tensor],
              weight_values: torch.Tensor | Sequence[float] | None = None, *, method: str = "scdf",
              floor: float = 0.0, normalize: bool = False, present: torch.Tensor | None = None,
              chars_per_token: torch.Tensor | Sequence[float] | None = None, mixture_weight: float = 0.0,
              task_shares: torch.Tensor | Sequence[float] | None = None) -> ScdfLoss:
    """The s-CDF objective ``L = sum_i w_i K_i`` on per-task minibatch estimates (per character:
    ``sum_i w_i K_i / rho_i``), optionally mixed with the natural mixture
    ``beta * sum_i pi_i K_i + (1 - beta) * sum_i w_i K_i``.

    Args:
        task_losses: [m] float tensor of per-task mean cross-entropies ``K_i`` carrying gradients w.r.t. the drafter
            (e.g. from :func:`per_task_mean`), or a sequence of m 0-dim tensors (stacked; their graphs are kept).
        weight_values: [m] values the weights are computed from (default: ``task_losses`` itself, i.e. the CE basis);
            pass per-task KL or TV for the other bases. Always detached.
        method, floor, normalize, present: see :func:`scdf_weights`. With ``present`` the tasks left out add
            nothing to the loss (their ``K_i`` may be NaN).
        chars_per_token: optional [m] characters per token ``rho_i`` (finite, > 0): the weights are computed on
            ``weight_values / rho`` and the loss is ``sum_i w_i K_i / rho_i`` (nats per character). Always detached.
        mixture_weight: ``beta`` in [0, 1], the share of the natural-mixture term ``sum_i pi_i K_i`` (see this
            module's docstring); above 0 it needs ``task_shares``, ``normalize=True`` and a corrective ``method``.
        task_shares: [m] ``pi``, every task's share of the training tokens (>= 0; renormalised to sum 1 over the
            present tasks). Always detached.

    Returns:
        :class:`ScdfLoss` with ``loss`` = ``sum_i w_i K_i`` (0-dim; ``sum_i w_i K_i / rho_i`` per character) and
        ``weights`` [m] (the ``w_i``). With ``method="exact_variance"`` and the CE basis, ``grad loss = (m/2) grad U``.
        With ``mixture_weight`` ``beta``, ``loss`` is the mixed objective and ``weights`` still the ``w_i``.
    """
    task_losses = _as_task_vector(task_losses, "task_losses", present)
    shares = _check_mixture(mixture_weight, task_shares, task_losses, normalize, method)
    basis = task_losses if weight_values is None else _as_task_vector(weight_values, "weight_values", present,
                                                                      like=task_losses)
    if chars_per_token is None:
        rho = torch.ones_like(basis)
    else:
        rho = _as_task_vector(chars_per_token, "chars_per_token", like=task_losses)
    _, weights, multipliers = per_character_weights(basis, rho, method=method, floor=floor, normalize=normalize,
                                                    present=present)
    if shares is not None:
        multipliers = mix_multipliers_unchecked(multipliers, shares, float(mixture_weight), present)
    terms = multipliers.to(task_losses.device, task_losses.dtype) * task_losses
    if present is not None:  # 0 * NaN is NaN: leave the absent tasks out explicitly (no gradient reaches them)
        terms = torch.where(present.to(terms.device), terms, torch.zeros_like(terms))
    return ScdfLoss(terms.sum(), weights.to(task_losses.device))


def per_task_mean(values: torch.Tensor, task_ids: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Differentiable per-task means of per-token values.

    Args:
        values: [N] float per-token values (e.g. cross-entropies ``H(p_n, q_n)``).
        task_ids: [N] int64 task index of each token, in ``[0, num_tasks)``.
        num_tasks: m.
    Returns:
        [m] float32: ``sum_{n: t_n = i} values_n / #{n: t_n = i}``; NaN for a task with no tokens (a 0 there would
        pass for a perfect task and shift the s-CDF weights: give :func:`scdf_loss` ``present=counts > 0``).
    """
    for name, tensor in (("values", values), ("task_ids", task_ids)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [N], got {type(tensor).__name__}")
    if values.dim() != 1 or task_ids.shape != values.shape:
        raise ValueError(f"values and task_ids must both have shape [N], got {tuple(values.shape)} and "
                         f"{tuple(task_ids.shape)}")
    _check_task_ids(task_ids, num_tasks)
    sums = torch.zeros(num_tasks, dtype=torch.float32, device=values.device).index_add(0, task_ids, values.float())
    counts = torch.bincount(task_ids, minlength=num_tasks).to(sums.dtype)
    means = sums / counts.clamp_min(1)
    return torch.where(counts > 0, means, torch.full_like(means, float("nan")))


def token_weights(task_ids: torch.Tensor, task_weights: torch.Tensor, task_counts: torch.Tensor) -> torch.Tensor:
    """Per-token weights ``w_{t_n} / count_{t_n}`` turning ``sum_n omega_n H_n`` into ``sum_i w_i K_i``.

    Args:
        task_ids: [N] int64; task_weights: [m] float; task_counts: [m] token counts per task (global over all
            processes under DDP, so that the per-process sums add up to the global objective).
    Returns:
        [N] float32 weights for :func:`specdec.fairness.divergences.divergence_loss` with ``reduction="sum"``.
    """
    if not isinstance(task_weights, torch.Tensor) or not isinstance(task_counts, torch.Tensor) or (
            task_weights.dim() != 1 or task_counts.shape != task_weights.shape):
        raise ValueError("task_weights and task_counts must both be tensors of shape [m]")
    if not isinstance(task_ids, torch.Tensor) or task_ids.dim() != 1:
        raise ValueError("task_ids must be a tensor of shape [N]")
    _check_task_ids(task_ids, task_weights.shape[0])
    return token_weights_unchecked(task_ids, task_weights, task_counts)


def token_weights_unchecked(task_ids: torch.Tensor, task_weights: torch.Tensor,
                            task_counts: torch.Tensor) -> torch.Tensor:
    """:func:`token_weights` without argument checks (no device sync), for the finetuning step loop, whose task ids
    it builds itself."""
    per_task = task_weights.float() / task_counts.float().clamp_min(1)
    return per_task.to(task_ids.device)[task_ids]


def _check_task_ids(task_ids: torch.Tensor, num_tasks: int) -> None:
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks must be an int >= 1, got {num_tasks!r}")
    if task_ids.dtype.is_floating_point or task_ids.dtype.is_complex or task_ids.dtype == torch.bool:
        raise TypeError(f"task_ids must be an integer tensor, got {task_ids.dtype}")
    if task_ids.numel():
        low, high = torch.stack(torch.aminmax(task_ids)).tolist()  # one device sync
        if low < 0 or high >= num_tasks:
            raise ValueError(f"task_ids must lie in [0, num_tasks={num_tasks}), got values in [{low}, {high}]")
