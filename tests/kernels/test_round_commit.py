"""The round-commit kernel equals its torch reference element for element (integer arithmetic) on random round
states: ragged acceptance, eos inside and after the accepted drafts, budgets that cut a round, finished rows, several
eos ids, plain rounds (K = 0); under every plan that covers the shape, batch sizes that are not tile multiples."""

import copy

import pytest
import torch

from specdec.kernels.round_commit import RoundCommitPlan, round_commit_plan, round_commit_triton
from specdec.kernels.round_commit_reference import RoundState, round_commit_reference

VOCAB = 50
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_device(state):
    return RoundState(**{name: value.to(DEVICE, copy=True) for name, value in vars(state).items()})


def _state(batch, capacity, max_drafts, generator):
    randint = lambda high, *shape: torch.randint(0, high, shape, generator=generator)  # noqa: E731
    slot_len = 5 + randint(20, batch)
    return RoundState(
        seq=randint(VOCAB, batch, capacity), slot_len=slot_len, prev=randint(VOCAB, batch),
        pending=randint(VOCAB, batch), generated=randint(12, batch), finished=randint(4, batch) == 0,
        stream_pos=randint(100, batch), drafted=randint(50, batch), accepted=randint(50, batch),
        verifier_calls=randint(20, batch), drafter_calls=randint(80, batch),
        accepted_per_position=randint(9, batch, max_drafts), attempted_per_position=randint(9, batch, max_drafts),
        flags=torch.full((5,), -7, dtype=torch.int64))


def _round(batch, num_drafts, generator):
    tokens = torch.randint(0, VOCAB, (batch, num_drafts + 1), generator=generator)
    num_accepted = torch.randint(0, num_drafts + 1, (batch,), generator=generator)
    index = torch.arange(num_drafts + 1)
    tokens = torch.where(index > num_accepted[:, None], -1, tokens)  # the sampler pads past n + 1 with -1
    return tokens, num_accepted


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
@pytest.mark.parametrize("num_drafts", [0, 1, 3, 4])
def test_round_commit_equals_reference(batch, num_drafts):
    generator = torch.Generator().manual_seed(batch * 10 + num_drafts)
    for trial in range(4):
        state = _state(batch, 48, 6, generator)
        tokens, num_accepted = _round(batch, num_drafts, generator)
        eos = torch.tensor([[3, 7], [-2, -2], [int(tokens[0, 0].clamp(min=0)), -2], [11, 12]][trial])
        max_new = torch.tensor([[14, 30, 12, 16][trial]])
        bad = torch.tensor(trial == 3)
        expected = copy.deepcopy(state)
        round_commit_reference(expected, tokens, num_accepted, bad, max_new, eos, num_drafts)
        state = _on_device(state)
        round_commit_triton(state, *(x.to(DEVICE) for x in (tokens, num_accepted, bad, max_new, eos)), num_drafts)
        for name, value in vars(expected).items():
            assert torch.equal(getattr(state, name).cpu(), value), (name, trial)


def test_every_covering_plan_gives_the_same_state():
    generator = torch.Generator().manual_seed(5)
    state = _state(5, 32, 4, generator)
    tokens, num_accepted = _round(5, 3, generator)
    eos, max_new, bad = torch.tensor([2]), torch.tensor([15]), torch.tensor(False)
    expected = copy.deepcopy(state)
    round_commit_reference(expected, tokens, num_accepted, bad, max_new, eos, 3)
    default = round_commit_plan(5, 3)
    assert (default.block_b, default.block_t, default.block_k) == (8, 4, 4)
    inputs = [x.to(DEVICE) for x in (tokens, num_accepted, bad, max_new, eos)]
    for plan in (default, RoundCommitPlan(16, 8, 8, 2), RoundCommitPlan(8, 4, 4, 4)):
        trial = _on_device(state)
        round_commit_triton(trial, *inputs, 3, plan=plan)
        assert all(torch.equal(getattr(trial, k).cpu(), v) for k, v in vars(expected).items()), plan


def test_a_round_cut_by_the_budget_and_an_eos_counts_what_was_decided():
    # hand-computed: row 0 accepts 3 of 4 drafts but may emit only 2 more tokens; row 1 emits an eos at t = 1;
    # row 2 has finished and must not move
    state = RoundState(
        seq=torch.zeros(3, 16, dtype=torch.int64), slot_len=torch.tensor([6, 4, 9]), prev=torch.tensor([1, 1, 1]),
        pending=torch.tensor([8, 8, 8]), generated=torch.tensor([8, 2, 10]),
        finished=torch.tensor([False, False, True]),
        stream_pos=torch.zeros(3, dtype=torch.int64), drafted=torch.zeros(3, dtype=torch.int64),
        accepted=torch.zeros(3, dtype=torch.int64), verifier_calls=torch.zeros(3, dtype=torch.int64),
        drafter_calls=torch.zeros(3, dtype=torch.int64), accepted_per_position=torch.zeros(3, 4, dtype=torch.int64),
        attempted_per_position=torch.zeros(3, 4, dtype=torch.int64), flags=torch.zeros(5, dtype=torch.int64))
    state = _on_device(state)
    tokens = torch.tensor([[20, 21, 22, 23, -1], [30, 2, 31, -1, -1], [40, 41, 42, 43, 44]], device=DEVICE)
    num_accepted = torch.tensor([3, 2, 4], device=DEVICE)
    round_commit_triton(state, tokens, num_accepted, torch.tensor(False, device=DEVICE),
                        torch.tensor([10], device=DEVICE), torch.tensor([2], device=DEVICE), 4)
    assert state.seq[0, 6:9].tolist() == [20, 21, 0] and state.seq[1, 4:7].tolist() == [30, 2, 0]
    assert state.seq[2].tolist() == [0] * 16
    assert state.generated.tolist() == [10, 4, 10] and state.slot_len.tolist() == [8, 6, 9]
    assert state.finished.tolist() == [True, True, True]
    assert state.accepted.tolist() == [3, 2, 0]  # decided past the budget counts; nothing after the eos
    assert state.attempted_per_position.sum(1).tolist() == [4, 2, 0]
    assert state.prev.tolist() == [22, 2, 1] and state.pending.tolist() == [23, 31, 8]
    assert state.drafted.tolist() == [4, 4, 0] and state.verifier_calls.tolist() == [1, 1, 0]
    assert state.flags.tolist() == [1, 0, 5, 6, 4]
