"""Counter-based random numbers shared by the Triton kernels and their torch references.

Every uniform is a pure function of ``(seed, position, index)``: ``seed`` is a per-row int64, ``position`` the
draft position of that row (an int64 offset plus the position inside the call) and ``index`` a vocabulary id in
``[0, V)`` or the reserved index :data:`ACCEPT_INDEX` for the accept test. Nothing depends on the batch a row sits
in or on the launch shape, so a kernel reproduces the reference bit for bit.

The mixing function is a 32-bit integer hash (a "lowbias32"-style xor-shift-multiply finaliser) applied in
rounds with keys derived from the seed and the position. In torch the unsigned 32-bit arithmetic is emulated in
int64; in Triton it is native ``uint32`` arithmetic. Uniforms are ``((bits >> 9) + 0.5) * 2**-23``: 2**23
equally spaced float32 values strictly inside (0, 1). Every one of them is exactly representable (k + 0.5 needs at
most 24 significant bits for k < 2**23), so no rounding can produce 0 or 1. (With 2**24 levels the top value,
2**24 - 0.5, would round to 2**24 and give u = 1.0 once in 2**24 draws.) The accept test uses these uniforms.

The race noise is an exponential ``E = -log u`` drawn from all 32 bits ``U`` (``u = (U + 0.5) 2**-32``), with its
float32 relative precision at both ends (:func:`bits_to_exponential`): for ``U < 2**31``, ``E = -log u``; above,
``E = -log(1 - s) = 2 atanh(s / (2 - s))`` with ``s = 1 - u = (~U + 0.5) 2**-32`` exact and the atanh a series, so
no logarithm of a number near 1 is taken (a fast ``lg2.approx`` there is off by up to 86% at ``u = 1 - 2**-24``).
The smallest noise is ``2**-33`` (23-bit uniforms stop at ``2**-24``) and the largest 22.9 (16.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF
ACCEPT_INDEX = 0xFFFFFFFF  # reserved stream index of the accept-test uniform (vocabulary ids stay below it)
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
_GOLDEN = 0x9E3779B9
_SALT_B = 0x85EBCA6B
_INV_2_23 = 1.0 / 8388608.0
_INV_2_32 = 2.0**-32
HALF32 = 0x80000000
# 2 atanh(z) = 2 z sum_n z**(2n) / (2n + 1); z <= 1/3, so eight terms reach float32 precision ((1/9)**8 / 17 < 2**-29)
ATANH_COEFFS = tuple(1.0 / (2 * n + 1) for n in range(8))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 tensors holding values in [0, 2**32), without int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mixer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per (seed, position); int64 tensors broadcast against each other.

    ``key_a`` steps through the positions of a seed with a Weyl sequence (``base_a + (pos + 1) G``), so the streams
    of two seeds whose ``base_a`` differ by ``d G`` would repeat each other ``d`` positions apart if it were the only
    key. ``key_b`` hashes the position together with a second digest of the seed, so it never follows such a shift:
    two (seed, position) pairs share their uniforms only if both 32-bit keys agree (about 2**-64 per pair). Both
    keys take all 64 bits of the seed and of the position."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    seed_lo = seeds & MASK32
    seed_hi = (seeds >> 32) & MASK32
    base_a = hash32(hash32(seed_lo ^ _GOLDEN) ^ seed_hi)
    base_b = hash32(hash32(seed_hi ^ _SALT_B) ^ seed_lo)
    pos_lo = positions & MASK32
    pos_hi = (positions >> 32) & MASK32
    key_a = hash32(((base_a + _mul32(pos_lo + 1, _GOLDEN)) & MASK32) ^ pos_hi)
    key_b = hash32(hash32(base_b ^ pos_lo) ^ pos_hi ^ _SALT_B)
    return key_a, key_b


def uniform_from_keys(key_a: torch.Tensor, key_b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) for int64 ``index`` values in [0, 2**32); keys broadcast against ``index``."""
    return bits_to_uniform(hash32(hash32((index & MASK32) ^ key_a) ^ key_b))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """Map int64 tensors holding 32-bit values to float32 uniforms strictly inside (0, 1) (exact arithmetic)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * _INV_2_23


def bits_to_exponential(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``E = -log u``, ``u = (bits + 0.5) 2**-32``, for int64 tensors holding 32-bit values: an Exp(1)
    sample in ``[2**-33, 22.9]`` with float32 relative precision at both ends (see the module docstring)."""
    low = bits < HALF32
    x = ((torch.where(low, bits, bits ^ MASK32)).to(torch.float32) + 0.5) * _INV_2_32  # u, or s = 1 - u; in (0, 1/2]
    z = x / (2.0 - x)
    z2 = z * z
    series = torch.full_like(z, ATANH_COEFFS[-1])
    for coeff in reversed(ATANH_COEFFS[:-1]):
        series = series * z2 + coeff
    return torch.where(low, -torch.log(x), 2.0 * z * series)


def exponential_from_keys(key_a: torch.Tensor, key_b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 Exp(1) race noise for int64 ``index`` values in [0, 2**32) (:func:`bits_to_exponential`)."""
    return bits_to_exponential(hash32(hash32((index & MASK32) ^ key_a) ^ key_b))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for the counter (seed, position, index); int64 inputs broadcast together."""
    key_a, key_b = stream_keys(seeds, positions)
    return uniform_from_keys(key_a, key_b, index.to(torch.int64))


# ---------------------------------------------------------------------------------------------------------------
# The same functions in Triton. Inputs are uint32 tensors or scalars; results match the torch versions bit for bit.


@triton.jit
def hash32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def stream_keys_tl(seed, position):
    """seed, position: int64 scalars or tensors. Returns (key_a, key_b) as uint32."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    base_a = hash32_tl(hash32_tl(seed_lo ^ 0x9E3779B9) ^ seed_hi)
    base_b = hash32_tl(hash32_tl(seed_hi ^ 0x85EBCA6B) ^ seed_lo)
    pos_lo = (position & 0xFFFFFFFF).to(tl.uint32)
    pos_hi = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key_a = hash32_tl((base_a + (pos_lo + 1) * 0x9E3779B9) ^ pos_hi)
    key_b = hash32_tl(hash32_tl(base_b ^ pos_lo) ^ pos_hi ^ 0x85EBCA6B)
    return key_a, key_b


@triton.jit
def uniform_from_keys_tl(key_a, key_b, index):
    """index: int32/int64/uint32 tensor of non-negative values below 2**32. Returns float32 in (0, 1)."""
    return bits_to_uniform_tl(hash32_tl(hash32_tl(index.to(tl.uint32) ^ key_a) ^ key_b))


@triton.jit
def bits_to_uniform_tl(bits):
    """uint32 bits -> float32 in (0, 1), bit-identical to :func:`bits_to_uniform`."""
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def log_tl(x, FAST_LOG: tl.constexpr):
    """``log(x)`` in fp32; FAST_LOG: one ``lg2.approx.f32`` times ln 2 instead of libdevice's ``logf`` (absolute
    error at most 2.3e-6 for x in [2**-24, 16), against 1.0e-6): for logs whose absolute error is what matters."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def bits_to_exponential_tl(bits, FAST_LOG: tl.constexpr):
    """uint32 bits -> float32 ``E = -log u`` as :func:`bits_to_exponential` (the log of ``u <= 1/2`` by
    :func:`log_tl`: relative error at most 3.4e-6 with FAST_LOG)."""
    low = bits < 0x80000000
    x = (tl.where(low, bits, bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    z = x / (2.0 - x)
    z2 = z * z
    series = 1.0 / 15.0
    series = series * z2 + 1.0 / 13.0
    series = series * z2 + 1.0 / 11.0
    series = series * z2 + 1.0 / 9.0
    series = series * z2 + 1.0 / 7.0
    series = series * z2 + 1.0 / 5.0
    series = series * z2 + 1.0 / 3.0
    series = series * z2 + 1.0
    return tl.where(low, -log_tl(x, FAST_LOG), 2.0 * z * series)


@triton.jit
def exponential_from_keys_tl(key_a, key_b, index, FAST_LOG: tl.constexpr):
    """index: int32/int64/uint32 tensor of non-negative values below 2**32. Returns float32 Exp(1) race noise."""
    return bits_to_exponential_tl(hash32_tl(hash32_tl(index.to(tl.uint32) ^ key_a) ^ key_b), FAST_LOG)
