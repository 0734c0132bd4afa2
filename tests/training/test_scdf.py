"""A constructed disparity case: s-CDF against the baselines (CPU, well under 2 minutes).

Two synthetic tasks over disjoint token ranges, each a first-order Markov chain (a random permutation followed with
probability 0.9 / 0.8, else a second permutation). The verifier is trained on both; the drafter on task "common"
and barely on task "rare". The finetuning data keeps that imbalance (200 vs 4 texts), so uniform KD on the natural
mixture mostly trains the task that is already good.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.fairness import evaluate, unfairness
from specdec.training.finetune import finetune_drafter
from specdec.training.losses import per_task_mean, scdf_loss, scdf_weights, token_weights

VOCAB = 40
BOS = 1
RANGES = {"common": (3, 20), "rare": (20, 40)}
STICK = {"common": 0.9, "rare": 0.8}
SEQ_LEN = 24


def _chains(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (low, high) in RANGES.items():
        size = high - low
        out[name] = ([low + int(i) for i in torch.randperm(size, generator=gen)],
                     [low + int(i) for i in torch.randperm(size, generator=gen)])
    return out


CHAINS = _chains(1234)


def make_texts(name: str, count: int, seed: int, length: int = SEQ_LEN) -> list[list[int]]:
    """``count`` token lists ``[BOS, x_1, ..., x_{length-1}]`` of task ``name``."""
    gen = torch.Generator().manual_seed(seed)
    low, high = RANGES[name]
    first, second = CHAINS[name]
    texts = []
    for _ in range(count):
        x = int(torch.randint(low, high, (1,), generator=gen))
        seq = [BOS, x]
        for _ in range(length - 2):
            table = first if float(torch.rand(1, generator=gen)) < STICK[name] else second
            x = table[x - low]
            seq.append(x)
        texts.append(seq)
    return texts


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=BOS,
                         eos_token_id=2, attn_implementation="eager")
    return LlamaForCausalLM(config)


def train_lm(model: LlamaForCausalLM, data: dict[str, list[list[int]]], mix: dict[str, float], steps: int,
             seed: int, batch: int = 32, lr: float = 3e-3) -> LlamaForCausalLM:
    """Plain next-token training on a task mixture (probabilities ``mix``)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    names = list(mix)
    probs = torch.tensor([mix[n] for n in names])
    model.train()
    for _ in range(steps):
        tasks = torch.multinomial(probs, batch, replacement=True, generator=gen).tolist()
        rows = [data[names[t]][int(torch.randint(len(data[names[t]]), (1,), generator=gen))] for t in tasks]
        ids = torch.tensor(rows)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def constructed_case() -> tuple[LlamaForCausalLM, LlamaForCausalLM, dict[str, list[list[int]]]]:
    pretrain = {name: make_texts(name, 400, seed=10 + i) for i, name in enumerate(RANGES)}
    verifier = train_lm(tiny_llama(64, 2, seed=0), pretrain, {"common": 0.5, "rare": 0.5}, steps=150, seed=0)
    drafter = train_lm(tiny_llama(32, 1, seed=1), pretrain, {"common": 0.97, "rare": 0.03}, steps=120, seed=1)
    return verifier, drafter, pretrain


@pytest.fixture(scope="module")
def case():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread start-up dominates, and the CPU is shared
    try:
        yield constructed_case()
    finally:
        torch.set_num_threads(threads)


def _metrics(report) -> dict[str, float]:
    return {"U_ce": report.summary["U_ce"], "U_kl": report.summary["U_kl"],
            "mean_alpha": report.summary["alpha_mean"], "worst_alpha": report.summary["alpha_min"]}


def test_scdf_lowers_unfairness_without_levelling_down(case):
    verifier, drafter0, _ = case
    finetune_data = {"common": make_texts("common", 200, seed=100), "rare": make_texts("rare", 4, seed=101)}
    eval_tasks = {name: {"texts": make_texts(name, 24, seed=200 + i),
                         "prompts": [t[:6] for t in make_texts(name, 4, seed=300 + i)]}
                  for i, name in enumerate(RANGES)}
    eval_kwargs = dict(num_draft_tokens=4, temperature=1.0, max_new_tokens=12, batch_size=8, cost_ratio=0.1,
                       progress=False, wall_clock=False)
    verifier_state = {k: v.clone() for k, v in verifier.state_dict().items()}

    before = evaluate(verifier, drafter0, eval_tasks, **eval_kwargs)
    print("\n" + before.to_markdown())
    common, rare = before.task("common"), before.task("rare")
    assert rare.alpha < common.alpha - 0.2, "the constructed case must show the disparity"
    assert rare.cross_entropy > common.cross_entropy
    assert before.summary["worst_task"] == "rare"
    assert before.summary["bound_violations"] == []

    results = {"none": _metrics(before)}
    reports = {}
    runs = {"uniform_kd": ("uniform_kd", "ce"), "balanced": ("balanced", "ce"),
            "exact_variance": ("exact_variance", "ce"), "scdf": ("scdf", "ce"), "scdf (kl basis)": ("scdf", "kl")}
    for label, (method, basis) in runs.items():
        drafter = copy.deepcopy(drafter0)
        finetune_drafter(drafter, verifier, finetune_data, method=method, weight_basis=basis, steps=60,
                         batch_size_per_task=8, seq_len=SEQ_LEN, lr=3e-3, eval_every=30, seed=0, progress=False)
        reports[label] = evaluate(verifier, drafter, eval_tasks, **eval_kwargs)
        results[label] = _metrics(reports[label])

    lines = [f"{'method':<16}{'U (CE)':>10}{'U (KL)':>10}{'mean α':>10}{'worst α':>10}"]
    for method, m in results.items():
        lines.append(f"{method:<16}{m['U_ce']:>10.4f}{m['U_kl']:>10.4f}{m['mean_alpha']:>10.4f}"
                     f"{m['worst_alpha']:>10.4f}")
    print("\n".join(lines))
    print("\nafter s-CDF (CE basis):\n" + reports["scdf"].to_markdown())

    base, scdf = results["none"], results["scdf"]
    assert scdf["U_ce"] <= 0.7 * base["U_ce"], "s-CDF must lower U on its weight basis (CE) by >= 30%"
    assert scdf["mean_alpha"] >= base["mean_alpha"], "s-CDF must not lower the mean acceptance"
    assert scdf["worst_alpha"] > base["worst_alpha"], "s-CDF must raise the worst task's acceptance"
    # U alone can be gamed: the exact-variance weights level the tasks by pushing the good one away from the verifier
    assert results["exact_variance"]["mean_alpha"] < scdf["mean_alpha"]
    # the verifier is frozen throughout
    for k, v in verifier.state_dict().items():
        assert torch.equal(v, verifier_state[k])


def test_scdf_weights_formulas():
    values = torch.tensor([1.0, 3.0, 2.0])
    assert torch.allclose(scdf_weights(values), torch.tensor([0.0, 2.0, 1.0]))
    assert torch.allclose(scdf_weights(values, floor=0.5), torch.tensor([0.5, 2.5, 1.5]))
    assert torch.allclose(scdf_weights(values, "exact_variance"), torch.tensor([-1.0, 1.0, 0.0]))
    assert torch.allclose(scdf_weights(values, "uniform"), torch.ones(3))
    assert torch.allclose(scdf_weights(values, normalize=True), torch.tensor([0.0, 2 / 3, 1 / 3]))
    assert not scdf_weights(values.requires_grad_()).requires_grad


def test_exact_variance_loss_is_half_m_grad_u():
    k = torch.tensor([0.7, 2.0, 1.1, 0.3], dtype=torch.float64, requires_grad=True)
    out = scdf_loss(k, method="exact_variance")
    (grad_loss,) = torch.autograd.grad(out.loss, k)
    u = ((k - k.mean()) ** 2).mean()
    (grad_u,) = torch.autograd.grad(u, k)
    assert torch.allclose(grad_loss, grad_u * k.numel() / 2)
    assert unfairness(k.detach()) == pytest.approx(float(u.detach()))


def test_scdf_loss_basis_and_token_weights():
    ce = torch.tensor([1.0, 2.0, 4.0, 0.5], requires_grad=True)
    task_ids = torch.tensor([0, 0, 1, 1])
    k = per_task_mean(ce, task_ids, 2)
    assert torch.allclose(k, torch.tensor([1.5, 2.25]))
    out = scdf_loss(k, weight_values=torch.tensor([0.1, 0.4]), floor=0.1)
    assert torch.allclose(out.weights, torch.tensor([0.1, 0.4]))
    tw = token_weights(task_ids, out.weights, torch.bincount(task_ids))
    assert torch.allclose((tw * ce).sum(), out.loss)


def test_a_task_missing_from_the_minibatch_is_left_out_of_the_weights():
    # tasks 0 and 1 have tokens, task 2 none: its mean is NaN (a 0 would pass for the best task and give every
    # present task weight K_i instead of K_i - min over the present tasks)
    ce = torch.tensor([1.0, 2.0, 4.0, 0.5], requires_grad=True)
    task_ids = torch.tensor([0, 0, 1, 1])
    k = per_task_mean(ce, task_ids, 3)
    assert torch.allclose(k[:2], torch.tensor([1.5, 2.25])) and bool(torch.isnan(k[2]))
    with pytest.raises(ValueError, match="present=counts > 0"):
        scdf_loss(k)
    present = torch.bincount(task_ids, minlength=3) > 0
    for method, expected in (("scdf", [0.0, 0.75, 0.0]), ("exact_variance", [-0.375, 0.375, 0.0]),
                             ("uniform", [1.0, 1.0, 0.0])):
        out = scdf_loss(k, method=method, present=present)
        assert torch.allclose(out.weights, torch.tensor(expected)), method
        assert torch.allclose(out.loss, (out.weights[:2] * k[:2]).sum())
        (grad,) = torch.autograd.grad(out.loss, ce, retain_graph=True)
        assert bool(torch.isfinite(grad).all())
        # d loss / d ce_n = w_{t_n} / count_{t_n}
        assert torch.allclose(grad, out.weights[task_ids] / 2)
    assert torch.allclose(scdf_weights(k, present=present, normalize=True), torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="present must have shape"):
        scdf_loss(k, present=present[:2])
    with pytest.raises(TypeError, match="present must be a bool tensor"):
        scdf_loss(k, present=present.int())
    with pytest.raises(ValueError, match="at least one task"):
        scdf_loss(k, present=torch.zeros(3, dtype=torch.bool))


def test_scdf_loss_keeps_the_graph_of_a_list_of_task_losses():
    drafter_param = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    task_losses = [drafter_param[0] * 2, drafter_param[1] ** 2, drafter_param[2] + 1]  # K = 2, 4, 4
    out = scdf_loss(task_losses)
    assert out.loss.requires_grad
    (grad,) = torch.autograd.grad(out.loss, drafter_param)
    assert torch.allclose(out.weights, torch.tensor([0.0, 2.0, 2.0]))
    assert torch.allclose(grad, torch.tensor([0.0, 2.0 * 2 * 2.0, 2.0]))


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    (dict(per_task_values=[1.0, 2.0], method="bogus"), ValueError, "method"),
    (dict(per_task_values=[1.0, 2.0], floor=-1.0), ValueError, "floor"),
    (dict(per_task_values=[1.0, 2.0], floor="x"), TypeError, "floor"),
    (dict(per_task_values=[]), ValueError, "per_task_values"),
    (dict(per_task_values="ab"), TypeError, "per_task_values"),
    (dict(per_task_values=[1.0, float("nan")]), ValueError, "per_task_values"),
])
def test_scdf_weights_bad_inputs(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        scdf_weights(**kwargs)


def test_scdf_loss_bad_inputs():
    with pytest.raises(ValueError, match="weight_values"):
        scdf_loss(torch.ones(3), weight_values=torch.ones(2))
    with pytest.raises(TypeError, match="task_losses"):
        scdf_loss(3.0)


def test_per_task_mean_and_token_weights_reject_bad_task_ids():
    values = torch.ones(4)
    with pytest.raises(ValueError, match="task_ids must lie in"):
        per_task_mean(values, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="task_ids must lie in"):
        per_task_mean(values, torch.tensor([0, -1, 0, 0]), 3)
    with pytest.raises(TypeError, match="task_ids"):
        per_task_mean(values, torch.zeros(4), 3)
    with pytest.raises(ValueError, match="num_tasks"):
        per_task_mean(values, torch.zeros(4, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="values"):
        per_task_mean([1.0, 2.0], torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="task_weights and task_counts"):
        token_weights(torch.zeros(4, dtype=torch.int64), torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="task_ids must lie in"):
        token_weights(torch.tensor([0, 2]), torch.ones(2), torch.ones(2))


def test_per_character_weights_and_loss():
    # w_i = D_i / rho_i - min_j D_j / rho_j, loss = sum_i w_i K_i / rho_i (nats per character)
    k = torch.tensor([2.0, 3.0, 1.2], dtype=torch.float64, requires_grad=True)
    d = torch.tensor([0.5, 1.2, 0.9], dtype=torch.float64)
    rho = torch.tensor([1.0, 4.0, 1.5], dtype=torch.float64)
    out = scdf_loss(k, weight_values=d, chars_per_token=rho)
    assert torch.allclose(out.weights.double(), torch.tensor([0.2, 0.0, 0.3], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(out.loss, (out.weights.double() * k / rho).sum())
    (grad,) = torch.autograd.grad(out.loss, k)
    assert torch.allclose(grad, out.weights.double() / rho)
    per_token = scdf_loss(k, weight_values=d)
    assert torch.allclose(per_token.weights.double(), torch.tensor([0.0, 0.7, 0.4], dtype=torch.float64))
    assert int(per_token.weights.argmax()) == 1 and int(out.weights.argmax()) == 2, "the order of the tasks changes"
    ones = scdf_loss(k, weight_values=d, chars_per_token=[1.0, 1.0, 1.0])
    assert torch.equal(ones.weights, per_token.weights) and torch.equal(ones.loss, per_token.loss)
    exact = scdf_loss(k, weight_values=d, chars_per_token=rho, method="exact_variance")
    assert torch.allclose(exact.weights.double(), d / rho - (d / rho).mean(), atol=1e-6)
    with pytest.raises(ValueError, match="chars_per_token must be > 0"):
        scdf_loss(k, chars_per_token=[1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="chars_per_token must have shape"):
        scdf_loss(k, chars_per_token=[1.0, 2.0])


@pytest.mark.parametrize(("rho", "error", "needle"), [
    (torch.tensor([1.0, 2.0]), ValueError, r"chars_per_token must have shape \[m\] = \(3,\) like per_task_values"),
    (torch.ones(3, 1), ValueError, r"chars_per_token must have shape \[m\] = \(3,\)"),
    (torch.tensor([1.0, 0.0, 2.0]), ValueError, r"chars_per_token must be > 0 and finite for every task"),
    (torch.tensor([1.0, -1.0, 2.0]), ValueError, r"chars_per_token must be > 0 and finite"),
    (torch.tensor([1.0, float("inf"), 2.0]), ValueError, r"chars_per_token must be > 0 and finite"),
    (torch.tensor([1.0, float("nan"), 2.0]), ValueError, r"chars_per_token must be > 0 and finite"),
    (torch.tensor([1, 2, 3]), TypeError, r"chars_per_token must be a float tensor \[m\]"),
    ([1.0, 2.0, 3.0], TypeError, r"chars_per_token must be a torch.Tensor of shape \[m\]"),
])
def test_per_character_weights_check_chars_per_token(rho, error, needle):
    from specdec.training.losses import per_character_weights

    values = torch.tensor([0.5, 1.2, 0.9])
    with pytest.raises(error, match=needle):
        per_character_weights(values, rho)
    good = per_character_weights(values, torch.tensor([1.0, 4.0, 1.5]))
    torch.testing.assert_close(good.values, values.double() / torch.tensor([1.0, 4.0, 1.5], dtype=torch.float64))
