"""Reference of the decode step's projections: ``x @ W^T`` for a few rows, with the epilogue of its place in a layer.

This is the definition :func:`specdec.kernels.gemv.gemv_triton` computes. Each epilogue reproduces the operations
Hugging Face's Llama-family layers run after the projection, in their cast order (every intermediate rounded to the
weight's dtype, as the separate torch operations round it).

Terms:
    ``x`` [M, K]: M = B T rows (B requests, T new tokens each). ``W`` [N_w, K]: an ``nn.Linear`` weight.
    ``bias`` [N_w] or None. ``dtype``: the weight's dtype; ``round`` casts float32 to it.

Formula (per row ``m``, feature ``n``; ``y = x @ W^T + bias`` accumulated in float32)::

    "none":      out[m, n] = round(y[m, n])                                   N = N_w
    "residual":  out[m, n] = round(float32(residual[m, n]) + round(y[m, n]))  N = N_w  (``residual + o_proj(h)``)
    "silu_mul":  g = round(y[m, n]);  u = round(y[m, I + n]);  I = N_w / 2,  N = I
                 out[m, n] = round(round(silu(g)) * u)                        (``act(gate_proj(h)) * up_proj(h)``)
"""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = ["EPILOGUES", "gemv_reference", "output_features"]

EPILOGUES = ("none", "residual", "silu_mul")


def output_features(weight_rows: int, epilogue: str) -> int:
    """N, the output width: the weight's rows, or half of them for ``"silu_mul"`` (gate rows, then up rows)."""
    return weight_rows // 2 if epilogue == "silu_mul" else weight_rows


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "none",
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` followed by ``epilogue``.

    Parameters
    ----------
    x : torch.Tensor
        [M, K], the dtype of ``weight``.
    weight : torch.Tensor
        [N_w, K] float32, float16 or bfloat16 (for ``"silu_mul"``: gate rows then up rows, N_w even).
    bias : torch.Tensor, optional
        [N_w], the dtype of ``weight``.
    epilogue : str
        ``"none"``, ``"residual"`` or ``"silu_mul"`` (module docstring).
    residual : torch.Tensor, optional
        [M, N_w], the dtype of ``weight``; required by ``"residual"``.

    Returns
    -------
    torch.Tensor
        [M, N] in the weight's dtype, contiguous (N from :func:`output_features`).
    """
    y = functional.linear(x, weight, bias)
    if epilogue == "residual":
        return (residual + y).contiguous()
    if epilogue == "silu_mul":
        gate, up = y.chunk(2, dim=-1)
        return (functional.silu(gate) * up).contiguous()
    return y.contiguous()
