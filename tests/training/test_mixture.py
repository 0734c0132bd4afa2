"""The corrective loss mixed with the natural mixture (``mixture_weight``): the interpolation computed by hand, its
end points (uniform KD, the corrective method alone), the token shares, refusals and resumes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specdec.training.checkpoint import CheckpointError
from specdec.training.config import FinetuneConfig, check_method_tasks
from specdec.training.finetune import _step_weights, finetune_drafter, task_token_shares
from specdec.training.losses import scdf_loss

from models import tiny_llama

VOCAB = 40
SMALL = dict(batch_size_per_task=3, seq_len=10, lr=1e-2, eval_every=2, progress=False, seed=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fixed_minibatch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifier and drafter logits [N, V] of 9 tokens over 3 tasks (4, 3 and 2 tokens), and their task ids [N]."""
    gen = torch.Generator().manual_seed(seed)
    task_ids = torch.tensor([0, 1, 0, 2, 1, 0, 1, 2, 0])
    return torch.randn(9, 7, generator=gen), torch.randn(9, 7, generator=gen) * 2, task_ids


def by_hand_task_ce(p_logits: torch.Tensor, q_logits: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
    """[m] per-task mean H(p, q) in float64, through masks (differentiable in ``q_logits``)."""
    ce = -(torch.softmax(p_logits.double(), -1) * torch.log_softmax(q_logits.double(), -1)).sum(-1)
    return torch.stack([ce[task_ids == i].mean() for i in range(3)])


# ------------------------------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("beta", [0.25, 0.5, 0.8])
@pytest.mark.parametrize("per_character", [False, True])
def test_the_mixed_loss_is_the_interpolation_of_the_two_losses(beta, per_character):
    p_logits, q_logits, task_ids = fixed_minibatch()
    shares = torch.tensor([5.0, 3.0, 2.0])  # renormalised to 0.5, 0.3, 0.2
    rho = torch.tensor([1.0, 2.5, 0.8]) if per_character else torch.ones(3)

    q_hand = q_logits.clone().requires_grad_(True)
    k = by_hand_task_ce(p_logits, q_hand, task_ids)
    uniform = (torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) * k).sum()
    per_char = k.detach() / rho.double()
    w = per_char - per_char.min()
    w = w / w.abs().sum()
    corrective = (w / rho.double() * k).sum()
    expected = beta * uniform + (1 - beta) * corrective
    expected.backward()

    q_code = q_logits.clone().requires_grad_(True)
    k_code = by_hand_task_ce(p_logits, q_code, task_ids).float()
    loss, weights = scdf_loss(k_code, normalize=True, mixture_weight=beta, task_shares=shares,
                              chars_per_token=rho if per_character else None)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(weights.double(), w, rtol=1e-5, atol=1e-7)  # the w_i, not the mixed multipliers
    torch.testing.assert_close(q_code.grad.double(), q_hand.grad.double(), rtol=1e-4, atol=1e-7)


def test_beta_one_gives_uniform_kd_and_beta_zero_the_corrective_loss_exactly():
    p_logits, q_logits, task_ids = fixed_minibatch(1)
    counts = torch.bincount(task_ids, minlength=3).double()

    # uniform KD on these tokens: the mean of H(p, q) over all of them; its token shares are N_i / N
    q_kd = q_logits.clone().requires_grad_(True)
    ce = -(torch.softmax(p_logits.double(), -1) * torch.log_softmax(q_kd.double(), -1)).sum(-1)
    ce.mean().backward()
    q_one = q_logits.clone().requires_grad_(True)
    scdf_loss(by_hand_task_ce(p_logits, q_one, task_ids), normalize=True, mixture_weight=1.0,
              task_shares=counts / counts.sum()).loss.backward()
    torch.testing.assert_close(q_one.grad, q_kd.grad, rtol=1e-6, atol=1e-9)

    grads = []
    for mixture in ({}, {"mixture_weight": 0.0, "task_shares": [0.2, 0.3, 0.5]}):
        q = q_logits.clone().requires_grad_(True)
        scdf_loss(by_hand_task_ce(p_logits, q, task_ids), normalize=True, **mixture).loss.backward()
        grads.append(q.grad)
    assert torch.equal(grads[0], grads[1])


def test_the_step_weights_mix_the_token_shares_with_the_corrective_weights():
    # per token CE, KL, TV of a constructed minibatch; tasks of 2, 3 and 1 tokens
    task_ids = torch.tensor([0, 0, 1, 1, 1, 2])
    div = SimpleNamespace(cross_entropy=torch.tensor([2.0, 3.0, 1.0, 2.0, 3.0, 4.0]),
                          kl=torch.tensor([0.4, 0.6, 0.3, 0.9, 1.2, 0.5]),
                          tv=torch.tensor([0.1, 0.3, 0.2, 0.2, 0.2, 0.4]))
    counts = torch.tensor([2.0, 3.0, 1.0], dtype=torch.float64)
    k = torch.tensor([2.5, 2.0, 4.0], dtype=torch.float64)
    d = torch.tensor([0.5, 0.8, 0.5], dtype=torch.float64)
    shares = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    cfg = FinetuneConfig(method="scdf", weight_basis="kl", normalize_weights=True)
    w = (d - d.min()) / (d - d.min()).sum()  # 0, 1, 0

    plain = _step_weights(cfg, task_ids, div, 3, False)
    zero = _step_weights(cfg.replace(mixture_weight=0.0), task_ids, div, 3, False, None, shares)
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], zero[:3], strict=True)) and plain[3] == zero[3]

    token_weights, weights, _, objective = _step_weights(cfg.replace(mixture_weight=0.4), task_ids, div, 3, False,
                                                         None, shares)
    multipliers = 0.4 * shares + 0.6 * w
    torch.testing.assert_close(weights.double(), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(token_weights.double(), (multipliers / counts)[task_ids], rtol=1e-6, atol=1e-7)
    assert objective == pytest.approx(float((multipliers * k).sum()), rel=1e-6)

    # beta = 1 with the minibatch's own token shares: uniform KD's per-token weights 1 / N
    uniform_kd = _step_weights(FinetuneConfig(method="uniform_kd"), task_ids, div, 3, False)
    one = _step_weights(cfg.replace(mixture_weight=1.0), task_ids, div, 3, False, None, counts / counts.sum())
    torch.testing.assert_close(one[0], uniform_kd[0], rtol=1e-6, atol=0.0)
    assert one[3] == pytest.approx(uniform_kd[3], rel=1e-6)


def test_token_shares_count_the_next_token_positions_of_the_cropped_texts():
    corpus = [[[1] * 4, [1] * 30], [[2] * 12], [[3] * 2, [3] * 3, [3] * 9]]
    # positions per text: min(len, 10) - 1 -> 3 + 9, 9, 1 + 2 + 8
    assert task_token_shares(corpus, 10) == pytest.approx([12 / 32, 9 / 32, 11 / 32], rel=1e-12)


# --------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("settings", "error", "needle"), [
    ({"mixture_weight": -0.1, "normalize_weights": True}, ValueError, r"mixture_weight must be a finite number >= 0"),
    ({"mixture_weight": 1.5, "normalize_weights": True}, ValueError, r"mixture_weight must be in \[0, 1\]"),
    ({"mixture_weight": float("nan"), "normalize_weights": True}, ValueError, r"mixture_weight must be a finite"),
    ({"mixture_weight": "0.5", "normalize_weights": True}, TypeError, r"mixture_weight must be a float"),
    ({"mixture_weight": True, "normalize_weights": True}, TypeError, r"mixture_weight must be a float"),
    ({"mixture_weight": 0.5}, ValueError, r"mixture_weight=0.5 needs normalize_weights=True"),
    ({"mixture_weight": 0.5, "normalize_weights": True, "method": "uniform_kd"}, ValueError,
     r"mixture_weight=0.5 mixes .* method 'uniform_kd' has no corrective term"),
    ({"mixture_weight": 0.5, "normalize_weights": True, "method": "balanced"}, ValueError,
     r"method 'balanced' has no corrective term"),
])
def test_bad_mixture_weights_are_refused_by_name(settings, error, needle):
    with pytest.raises(error, match=needle):
        FinetuneConfig(**settings)


def test_the_mixture_is_accepted_where_it_has_a_corrective_term_and_kept_as_a_float():
    for method in ("scdf", "exact_variance"):
        for per_character in (False, True):
            cfg = FinetuneConfig(method=method, per_character=per_character, mixture_weight=1, normalize_weights=True)
            assert cfg.mixture_weight == 1.0 and isinstance(cfg.mixture_weight, float)
    for method in ("uniform_kd", "balanced"):
        assert FinetuneConfig(method=method, mixture_weight=0.0).mixture_weight == 0.0
    # one task: the corrective weight is 0, but the mixture still trains it
    check_method_tasks(FinetuneConfig(mixture_weight=0.5, normalize_weights=True), ["en"])
    with pytest.raises(ValueError, match="or mixture_weight > 0"):
        check_method_tasks(FinetuneConfig(), ["en"])


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"mixture_weight": 0.5, "normalize": True}, ValueError, "needs task_shares"),
    ({"mixture_weight": 0.5, "task_shares": [1.0, 1.0, 1.0]}, ValueError, "needs normalize=True"),
    ({"mixture_weight": 0.5, "normalize": True, "task_shares": [1.0, -1.0, 1.0]}, ValueError,
     r"task_shares must be >= 0"),
    ({"mixture_weight": 0.5, "normalize": True, "task_shares": [1.0, 1.0]}, ValueError, r"task_shares must have shape"),
    ({"mixture_weight": 2.0, "normalize": True, "task_shares": [1.0, 1.0, 1.0]}, ValueError,
     r"mixture_weight must be in \[0, 1\]"),
    ({"mixture_weight": 0.5, "normalize": True, "task_shares": [1.0, 1.0, 1.0], "method": "uniform"}, ValueError,
     "use method 'scdf' or 'exact_variance'"),
])
def test_scdf_loss_refuses_a_bad_mixture_by_name(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        scdf_loss(torch.tensor([1.0, 2.0, 3.0]), **kwargs)


# ------------------------------------------------------------------------------------------------- finetuning
def make_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    return (tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=0, init_std=0.3),
            tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=1, init_std=0.3))


def make_tasks() -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return {"a": [torch.randint(3, 20, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(8)],
            "b": [torch.randint(20, VOCAB, (12,), generator=gen).tolist() for _ in range(4)]}


def test_a_mixed_per_character_run_logs_the_mixed_objective():
    verifier, drafter = make_pair()
    tasks = make_tasks()
    rho = {"a": 1.5, "b": 4.0}
    seen = []
    finetune_drafter(drafter, verifier, tasks, method="scdf", weight_basis="ce", per_character=True,
                     normalize_weights=True, mixture_weight=0.3, chars_per_token=rho, eval_fraction=0,
                     callback=lambda step, info: seen.append(info), **{**SMALL, "steps": 2})
    positions = {name: sum(min(len(t), 10) - 1 for t in texts) for name, texts in tasks.items()}
    shares = [positions[name] / sum(positions.values()) for name in ("a", "b")]
    assert len(seen) == 2
    for info in seen:
        assert info["task_shares"] == pytest.approx(shares, rel=1e-12)
        assert sum(abs(x) for x in info["weights"]) == pytest.approx(1.0, rel=1e-6)
        # the task values are K_i / rho_i per character on the CE basis
        k = [value * rho[name] for value, name in zip(info["task_values"], ("a", "b"), strict=True)]
        expected = sum((0.3 * pi + 0.7 * w / rho[name]) * k_i
                       for pi, w, name, k_i in zip(shares, info["weights"], ("a", "b"), k, strict=True))
        assert info["loss"] == pytest.approx(expected, rel=1e-5)


def test_one_task_trains_under_the_mixture():
    verifier, drafter = make_pair()
    before = copy.deepcopy(drafter)
    finetune_drafter(drafter, verifier, {"a": make_tasks()["a"]}, normalize_weights=True, mixture_weight=0.5,
                     **{**SMALL, "steps": 1})
    assert any(not torch.equal(a, b) for a, b in zip(drafter.parameters(), before.parameters(), strict=True))


def test_a_resume_with_another_mixture_weight_is_refused(tmp_path):
    verifier, drafter = make_pair()
    tasks = make_tasks()
    settings = {**SMALL, "normalize_weights": True, "checkpoint_dir": tmp_path}
    finetune_drafter(copy.deepcopy(drafter), verifier, tasks, mixture_weight=0.5, steps=2, **settings)
    for other in (0.25, 0.0):
        with pytest.raises(CheckpointError, match=r"different settings \(mixture_weight\)"):
            finetune_drafter(copy.deepcopy(drafter), verifier, tasks, mixture_weight=other, steps=3, **settings)
    result = finetune_drafter(copy.deepcopy(drafter), verifier, tasks, mixture_weight=0.5, steps=3, **settings)
    assert result.resumed_from == 2
