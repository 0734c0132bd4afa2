"""Shared cases of the Triton rejection sampler's tests: correlated target/draft logits, the automatic launch plan of
a shape on this device, and the exact comparison with the torch reference (tokens and counts equal, scores to fp32
rounding). Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton loads)."""


import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specdec.kernels._device import DeviceFacts  # noqa: E402
from specdec.kernels.rejection_sampling import rejection_sample_triton  # noqa: E402
from specdec.kernels.rejection_sampling_plan import (  # noqa: E402
    LaunchPlan,
    plan_launch,
)
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (too slow in Triton's interpreter)")
_INTERPRET_ON = os.environ.get("TRITON_INTERPRET") == "1"
H100 = DeviceFacts(sm_count=132, major=9, name="NVIDIA H100 80GB HBM3", interpreter=False)
INTERPRETER = DeviceFacts(sm_count=4, major=0, name="", interpreter=True)


def make_case(batch, num_drafts, vocab, dtype=torch.float32, seed=0, scale=2.0, noise=0.7, temperature=1.0):
    """Correlated target/draft logits (alpha ~ 0.6-0.8), drafts sampled from q, random seeds and int64 offsets."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen, device=DEVICE) * scale
    draft = target[:, :num_drafts] + noise * torch.randn(batch, num_drafts, vocab, generator=gen, device=DEVICE)
    target, draft = target.to(dtype), draft.to(dtype)
    gumbel = -torch.log(-torch.log(torch.rand(batch, num_drafts, vocab, generator=gen, device=DEVICE)))
    drafts = torch.argmax(draft.float() / max(temperature, 1e-3) + gumbel, dim=-1)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=DEVICE)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=DEVICE)
    return target, draft, drafts, seeds, offsets


def plan_for(target, **changes) -> LaunchPlan:
    """The automatic plan of ``target``'s shape and dtype on this device (sampled rows, no scores), with
    ``changes``; the launcher turns off what a call cannot use."""
    batch, positions, vocab = target.shape
    return replace(plan_launch(batch, positions - 1, vocab, target.dtype, DEVICE), **changes)


def assert_matches_reference(target, draft, drafts, seeds, offsets, temperature, plan=None, **kwargs):
    """The Triton sampler gives the reference's tokens and counts exactly; scores agree to fp32 rounding."""
    scores = kwargs.pop("compute_scores", False)
    ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                     **kwargs)
    out = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                  plan=plan, **kwargs)
    bad = (out[0] != ref[0]).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ: {out[0][bad[:2]].tolist()} vs {ref[0][bad[:2]].tolist()}"
    assert torch.equal(out[1], ref[1])
    if scores:
        torch.testing.assert_close(out[2], ref[2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[3], ref[3], rtol=1e-4, atol=1e-5)
    return ref


def h100_plan(batch, num_drafts, vocab, dtype=torch.float32, **kwargs) -> LaunchPlan:
    """The automatic plan an H100 would get."""
    return plan_launch(batch, num_drafts, vocab, dtype, H100, **kwargs)


class StatsLaunchSpy:
    """Stands in for the statistics kernel in the launcher: counts the positions the launches cover (grid
    ``(B * positions, S)``) and keeps the last launch's grid and statistics partials, then launches the real
    kernel."""

    def __init__(self, kernel, batch: int = 1):
        self.kernel, self.batch, self.positions, self.grid, self.stats = kernel, batch, 0, None, None

    def __getitem__(self, grid):
        self.positions += grid[0] // self.batch
        self.grid = grid

        def launch(*args, **kwargs):
            self.stats = args[5]
            return self.kernel[grid](*args, **kwargs)
        return launch

    def take(self) -> int:
        """Positions launched since the last call."""
        positions, self.positions = self.positions, 0
        return positions
