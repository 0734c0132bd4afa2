"""Reference of RMS normalisation as Hugging Face's Llama, Mistral and Qwen models compute it (``LlamaRMSNorm``).

This is the definition :func:`specdec.kernels.rms_norm.rms_norm_triton` computes, cast order included: the row is
normalised in float32, rounded to the input's dtype, then multiplied by the weight in that dtype.

Terms:
    row: the last dimension of ``x`` (``N`` features: the hidden size, or the head dimension for Qwen3's ``q_norm``
    and ``k_norm``). ``eps``: the model's ``rms_norm_eps``.

Formula (per row)::

    r   = 1 / sqrt(mean(float32(x)^2) + eps)
    out = weight * dtype(float32(x) * r)          (the product in the dtype, as ``weight * h.to(dtype)``)
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of every row of ``x``.

    Parameters
    ----------
    x : torch.Tensor
        [..., N] float32, float16 or bfloat16; any strides.
    weight : torch.Tensor
        [N], the dtype of ``x``.
    eps : float
        Added to the mean square before the reciprocal square root.

    Returns
    -------
    torch.Tensor
        [..., N] in the dtype of ``x``, contiguous.
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).contiguous()
