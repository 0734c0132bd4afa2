"""The counter-based random stream: Triton reproduces torch bit for bit; uniforms are uniform and in (0, 1); the race
noise is Exp(1) with float32 relative precision over all 32-bit patterns."""

import math

import pytest
import torch
import triton
import triton.language as tl

from specdec.kernels.rng import (
    ACCEPT_INDEX,
    bits_to_exponential,
    bits_to_exponential_tl,
    bits_to_uniform,
    bits_to_uniform_tl,
    exponential_from_keys,
    hash32,
    stream_keys,
    stream_keys_tl,
    uniform,
    uniform_from_keys_tl,
)

from stats import assert_follows


@triton.jit
def _uniform_kernel(seeds_ptr, positions_ptr, out_ptr, num_index, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    key_a, key_b = stream_keys_tl(seed, position)
    index = tl.arange(0, BLOCK)
    values = uniform_from_keys_tl(key_a, key_b, index)
    tl.store(out_ptr + row * (num_index + 1) + index, values, mask=index < num_index)
    accept = uniform_from_keys_tl(key_a, key_b, tl.full([1], 0xFFFFFFFF, tl.uint32))
    tl.store(out_ptr + row * (num_index + 1) + num_index + tl.arange(0, 1), accept)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernels run in Triton's interpreter


def test_triton_stream_matches_torch_bit_for_bit():
    seeds = torch.tensor([0, 1, -5, 2**62 + 12345, 7, 7], dtype=torch.int64)
    positions = torch.tensor([0, 3, 2**40 + 1, 9, 0, 1], dtype=torch.int64)
    num_index = 200
    out = torch.empty(len(seeds), num_index + 1, dtype=torch.float32, device=DEVICE)
    _uniform_kernel[(len(seeds),)](seeds.to(DEVICE), positions.to(DEVICE), out, num_index, BLOCK=256)
    out = out.cpu()
    index = torch.cat([torch.arange(num_index), torch.tensor([ACCEPT_INDEX])])
    expected = uniform(seeds[:, None], positions[:, None], index[None, :])
    assert torch.equal(out, expected)


def test_streams_of_two_seeds_never_repeat_each_other_at_a_shift():
    # key_a walks the positions of a seed with a Weyl step, so among 2**16 seeds some pairs have key_a sequences that
    # are shifts of each other (base_a2 = base_a1 + d * G); their uniforms must still differ: key_b does not shift
    seeds = torch.arange(2**16, dtype=torch.int64) * 7919 + 12345
    key_a0, _ = stream_keys(seeds, torch.zeros_like(seeds))
    order = torch.argsort(key_a0)
    found = None
    for shift in range(1, 9):  # stream(s1, p + shift) has the key_a of stream(s2, p) for every p
        shifted, _ = stream_keys(seeds, torch.full_like(seeds, shift))
        at = torch.searchsorted(key_a0[order], shifted).clamp(max=len(seeds) - 1)
        hits = (key_a0[order][at] == shifted).nonzero().flatten()
        if len(hits):
            found = (int(seeds[hits[0]]), int(seeds[order[at[hits[0]]]]), shift)
            break
    assert found is not None, "no Weyl-aligned pair among 2**16 seeds: the test lost its power"
    s1, s2, shift = found
    positions = torch.arange(16, dtype=torch.int64)
    a1, _ = stream_keys(torch.tensor(s1), positions + shift)
    a2, _ = stream_keys(torch.tensor(s2), positions)
    assert torch.equal(a1, a2)  # the aligned pair (what made runs of shared uniforms possible)
    index = torch.arange(300, dtype=torch.int64)
    u1 = uniform(torch.tensor(s1), (positions + shift)[:, None], index[None, :])
    u2 = uniform(torch.tensor(s2), positions[:, None], index[None, :])
    assert float((u1 == u2).float().mean()) < 1e-3


def test_the_high_bits_of_the_position_count():
    index = torch.arange(100, dtype=torch.int64)
    low = uniform(torch.tensor(3), torch.tensor(5), index)
    high = uniform(torch.tensor(3), torch.tensor(2**32 + 5), index)
    assert float((low == high).float().mean()) < 0.05


def test_hash_is_a_bijection_on_a_block():
    values = hash32(torch.arange(1 << 16, dtype=torch.int64))
    assert torch.unique(values).numel() == 1 << 16
    assert int(values.min()) >= 0 and int(values.max()) < 2**32


def test_uniforms_are_strictly_inside_unit_interval_and_uniform():
    seeds = torch.arange(64, dtype=torch.int64)[:, None]
    values = uniform(seeds, torch.zeros_like(seeds), torch.arange(4096)[None, :]).flatten()
    assert float(values.min()) > 0.0 and float(values.max()) < 1.0
    counts = torch.histc(values, bins=64, min=0.0, max=1.0)
    assert_follows(counts, torch.full((64,), 1 / 64), what="uniform histogram")
    # Neighbouring positions and seeds are uncorrelated.
    a = uniform(seeds, torch.zeros_like(seeds), torch.arange(4096)[None, :]).flatten()
    b = uniform(seeds, torch.ones_like(seeds), torch.arange(4096)[None, :]).flatten()
    c = uniform(seeds + 1, torch.zeros_like(seeds), torch.arange(4096)[None, :]).flatten()
    for other in (b, c):
        corr = float(torch.corrcoef(torch.stack([a, other]))[0, 1])
        assert abs(corr) < 10 / math.sqrt(a.numel())


@triton.jit
def _bits_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, bits_to_uniform_tl(bits), mask=offs < n)


def test_extreme_bits_map_strictly_inside_the_unit_interval_in_torch_and_triton():
    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    values = bits_to_uniform(bits)
    assert float(values.min()) > 0.0 and float(values.max()) < 1.0
    assert float(values[-1]) == 1.0 - 2.0**-24 and float(values[0]) == 2.0**-24
    out = torch.empty(len(bits), dtype=torch.float32, device=DEVICE)
    _bits_kernel[(1,)](bits.to(DEVICE), out, len(bits), BLOCK=16)
    assert torch.equal(out.cpu(), values)


@triton.jit
def _exponential_kernel(bits_ptr, out_ptr, n, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, bits_to_exponential_tl(bits, FAST_LOG), mask=offs < n)


def _exact_exponential(bits: torch.Tensor) -> torch.Tensor:
    """float64 ``-log u`` for ``u = (bits + 0.5) 2**-32``, through log1p near u = 1."""
    u = (bits.double() + 0.5) * 2.0**-32
    return torch.where(u <= 0.5, -torch.log(u), -torch.log1p(-((2.0**32 - 1 - bits.double()) + 0.5) * 2.0**-32))


EXTREME_BITS = [0, 1, 2, 511, 2**24, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2**24, 2**32 - 513, 2**32 - 512,
                2**32 - 3, 2**32 - 2, 2**32 - 1]


@pytest.mark.parametrize("fast_log", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="FAST_LOG is inline PTX (lg2.approx), which only a CUDA GPU runs"))])
def test_race_noise_has_float32_relative_precision_at_both_ends(fast_log):
    # the largest uniforms give the smallest noise: -log u of a 23-bit uniform stops at 2**-24 (and a fast log of it
    # is off by 86%); every one of the 2**32 bit patterns must give -log u to float32 relative precision
    gen = torch.Generator().manual_seed(3)
    bits = torch.cat([torch.tensor(EXTREME_BITS, dtype=torch.int64),
                      torch.randint(0, 2**32, (20000,), generator=gen, dtype=torch.int64)])
    exact = _exact_exponential(bits)
    values = bits_to_exponential(bits)
    assert float(((values.double() - exact).abs() / exact).max()) < 4e-7
    assert float(values[len(EXTREME_BITS) - 1]) < 2.0**-32  # the largest uniform: E = 2**-33 (1 + 2**-33)
    top = values[len(EXTREME_BITS) - 5:len(EXTREME_BITS)]  # the five largest uniforms, 2**32 - 513 ... 2**32 - 1
    assert len(set(top.tolist())) == 5  # neighbours at the top differ (one 23-bit uniform holds all five)
    out = torch.empty(len(bits), dtype=torch.float32, device=DEVICE)
    _exponential_kernel[(1,)](bits.to(DEVICE), out, len(bits), FAST_LOG=fast_log,
                              BLOCK=triton.next_power_of_2(len(bits)))
    bound = 3.5e-6 if fast_log else 4e-7  # libdevice's logf, or lg2.approx (absolute error 2.3e-6 for u <= 1/2)
    assert float(((out.cpu().double() - exact).abs() / exact).max()) < bound


def test_race_noise_is_exponential():
    # Exp(1): P(E > t) = exp(-t); 64 equal-probability bins, and the far tails a 23-bit uniform cannot reach
    seeds = torch.arange(64, dtype=torch.int64)
    key_a, key_b = stream_keys(seeds[:, None], torch.zeros(64, 1, dtype=torch.int64))
    noise = exponential_from_keys(key_a, key_b, torch.arange(2**14)[None, :]).flatten().double()
    bins = torch.clamp((torch.exp(-noise) * 64).floor().long(), max=63)
    assert_follows(torch.bincount(bins, minlength=64), torch.full((64,), 1 / 64), what="noise quantile histogram")
    assert float(noise.min()) > 0.0 and bool(torch.isfinite(noise).all())
