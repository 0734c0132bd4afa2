"""Block verification in the race kernel: the block weights, the rows a stop can need, and the stop position.

A mode of the rejection sampler (``verification="block"``, constexpr ``BLOCK_VERIFY`` of
:func:`~specdec.kernels.rejection_sampling_kernels._race_kernel`), not an op of its own: the statistics kernel is
unchanged, and the race kernel derives everything below from the combined statistics in registers. Definition:
:func:`~specdec.kernels.rejection_sampling_reference.block_stop`; derivation and proof: ``docs/rejection_sampling.md``.

Terms (row ``b`` with ``n_b`` drafts, vectors over positions ``i = 0 .. JP2 - 1``):
    ``a_i = log P_i``: ``a_0 = 0``, ``a_{i+1} = min(0, a_i + log p_i(x_i) - log q_i(x_i))`` (``-inf`` past a draft
    that cannot be kept: no draft, ``q(x) = 0``, ``p(x) = 0`` or no statistics).
    ``eta_i``: the accept uniform of draft ``i - 1`` (``eta_0 = 1``, unused).
    candidate ``i``: ``1 <= i <= n_b`` and ``log eta_i <= a_i``; certain: a candidate with ``i = n_b`` or
    ``a_i >= -CERTAIN_EPS`` (``BLOCK_CERTAIN_EPS``: ``P_i`` is 1 up to rounding).
    ``W_i = sum_x max(0, P_i p_i(x) - q_i(x))``, read back from the race programs' partial masses.
    success ``i``: a certain candidate, or a candidate with ``eta_i (W_i + 1 - P_i) <= W_i``; the stop ``tau`` is
    the largest success (0 when none).

The highest certain candidate ``f`` succeeds whatever the masses, so the stop is ``f`` or a candidate above it: the
race programs read exactly those rows (:func:`_block_rows`), typically one or two, and row 0 only when no candidate is
certain.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_log_weights(lp, lq, lt, t_x, d_x, delta, real, u, js, JP2: tl.constexpr):
    """``(a, eta)`` [JP2] fp32 from the per-position ``log p(x_i)``, ``log q(x_i)``, ``L_t``, scaled draft logits
    ``t_x``, ``d_x``, ``delta = L_d - L_t`` and accept uniforms ``u`` ([JP2] each; ``real``: positions with a
    draft). The ratio is ``(t_x - d_x) + delta`` and the recurrence runs in position order, an fp32 add then a min,
    as :func:`~specdec.kernels.rejection_sampling_reference.block_log_weights` does."""
    keep = real & (lq > float("-inf")) & (lp > float("-inf")) & (lt > float("-inf"))  # (NaN compares false)
    ratio = tl.where(keep, (t_x - d_x) + delta, float("-inf"))
    a = tl.zeros([JP2], tl.float32)
    eta = tl.full([JP2], 1.0, tl.float32)
    run = tl.sum(a, axis=0)  # 0.0 as an fp32 scalar
    for i in tl.static_range(1, JP2):
        prev = js == i - 1
        run = tl.minimum(run + tl.sum(tl.where(prev, ratio, 0.0), axis=0), 0.0)
        a = tl.where(js == i, run, a)
        eta = tl.where(js == i, tl.sum(tl.where(prev, u, 0.0), axis=0), eta)
    return a, eta


@triton.jit
def _block_candidates(a, eta, n_b, js, CERTAIN_EPS: tl.constexpr):
    """([JP2] candidate, [JP2] certain) masks of the positions (module docstring)."""
    candidate = (js >= 1) & (js <= n_b) & (tl.log(eta) <= a)
    return candidate, candidate & ((a >= -CERTAIN_EPS) | (js == n_b))


@triton.jit
def _block_rows(a, eta, n_b, js, CERTAIN_EPS: tl.constexpr):
    """[JP2] bool: the rows whose race a stop can need: the highest certain candidate (row 0 when there is none) and
    every candidate above it."""
    candidate, certain = _block_candidates(a, eta, n_b, js, CERTAIN_EPS)
    floor = tl.max(tl.where(certain, js, 0), axis=0)
    return (js == floor) | (candidate & (js > floor))


@triton.jit
def _block_stop(race_ptr, b, K, S2, a, eta, need, n_b, js, MASS_EPS: tl.constexpr, CERTAIN_EPS: tl.constexpr,
                SP2: tl.constexpr):
    """The stop ``tau`` (int32) of sampled row ``b``: the masses ``W_i`` of the rows ``need`` summed over the row's
    ``S2`` race programs (``race``: [B, S2, K + 1, 6] fp32, the mass at index 4), masses ``<= MASS_EPS`` as 0, then
    the largest success (module docstring)."""
    ss = tl.arange(0, SP2)
    off = ((b.to(tl.int64) * S2 + ss[:, None]) * (K + 1) + js[None, :]) * 6 + 4
    part = tl.load(race_ptr + off, mask=(ss[:, None] < S2) & need[None, :], other=0.0, cache_modifier=".cg")
    mass = tl.sum(part, axis=0)
    mass = tl.where(mass > MASS_EPS, mass, 0.0)
    candidate, certain = _block_candidates(a, eta, n_b, js, CERTAIN_EPS)
    success = need & candidate & (certain | (eta * (mass + (1.0 - tl.exp(a))) <= mass))
    return tl.max(tl.where(success, js, 0), axis=0)
