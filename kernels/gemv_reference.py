"""Reference of the decode step's projections: ``x @ W^T`` for a few rows, with the prologue and epilogue of its
place in a layer.

This is the definition :func:`specdec.kernels.gemv.gemv_triton` computes. The prologue is the RMS norm that precedes
the projection (the layer's input or post-attention norm, or the final norm before the head); each epilogue
reproduces the operations Hugging Face's Llama-family layers run after the projection. The cast order is theirs:
every intermediate rounded to the weight's dtype, as the separate torch operations round it.

Terms:
    ``x`` [M, K]: M = B T rows (B requests, T new tokens each). ``W`` [N_w, K]: an ``nn.Linear`` weight.
    ``bias`` [N_w] or None. ``dtype``: the weight's dtype; ``round`` casts float32 to it.

Formula (per row ``m``, feature ``n``; ``y = h @ W^T + bias`` accumulated in float32, with ``h = x``, or
``h = rms_norm_reference(x, norm_weight, eps)`` when a norm weight is given)::

    "none":      out[m, n] = round(y[m, n])                                   N = N_w
    "residual":  out[m, n] = round(float32(residual[m, n]) + round(y[m, n]))  N = N_w  (``residual + o_proj(h)``)
    "silu_mul":  g = round(y[m, n]);  u = round(y[m, I + n]);  I = N_w / 2,  N = I
                 out[m, n] = round(round(silu(g)) * u)                        (``act(gate_proj(h)) * up_proj(h)``)
"""

from __future__ import annotations

import torch
from torch.nn import functional

from .rms_norm_reference import rms_norm_reference

__all__ = ["EPILOGUES", "gemv_reference", "output_features"]

EPILOGUES = ("none", "residual", "silu_mul")


def output_features(weight_rows: int, epilogue: str) -> int:
    """N, the output width: the weight's rows, or half of them for ``"silu_mul"`` (gate rows, then up rows)."""
    return weight_rows // 2 if epilogue == "silu_mul" else weight_rows


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "none",
                   residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """``rms_norm(x) @ weight^T (+ bias)`` (or ``x @ weight^T (+ bias)``) followed by ``epilogue``.

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
    norm_weight : torch.Tensor, optional
        [K], the dtype of ``weight``: RMS-normalise the rows of ``x`` first (epsilon ``eps``).

    Returns
    -------
    torch.Tensor
        [M, N] in the weight's dtype, contiguous (N from :func:`output_features`).
    """
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    y = functional.linear(x, weight, bias)
    if epilogue == "residual":
        return (residual + y).contiguous()
    if epilogue == "silu_mul":
        gate, up = y.chunk(2, dim=-1)
        return (functional.silu(gate) * up).contiguous()
    return y.contiguous()
