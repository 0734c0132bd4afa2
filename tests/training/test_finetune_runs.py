"""finetune_drafter's measurements and runs against values computed here: modes and precision of the evaluations,
characters per token, the evaluated tasks, what a resume compares, one-task runs, Ctrl-C, and the result's repr."""

from __future__ import annotations

import copy
import os
import signal
import stat

import pytest
import torch

from specdec._models import float32_logits
from specdec.training import finetune as finetune_module
from specdec.training.checkpoint import CHECKPOINT_NAME, CheckpointError
from specdec.training.finetune import FinetuneInterrupted, finetune_drafter

from models import tiny_llama

VOCAB = 40

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_pair(**overrides: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=0, init_std=0.3, **overrides)
    drafter = tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=1, init_std=0.3, **overrides)
    return verifier, drafter


def make_tasks(seed: int = 0, high: int = VOCAB) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": [torch.randint(3, 20, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(8)],
            "b": [torch.randint(20, high, (12,), generator=gen).tolist() for _ in range(4)]}


SMALL = dict(batch_size_per_task=3, seq_len=10, lr=1e-2, eval_every=2, progress=False, seed=0)


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def by_hand(verifier, drafter, texts: list[list[int]]) -> dict[str, float]:
    """Mean over every prefix of H(p, q) and KL(p || q), each text alone through eval-mode copies in float64."""
    verifier, drafter = copy.deepcopy(verifier).eval().double(), copy.deepcopy(drafter).eval().double()
    ce, kl = [], []
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            log_p = torch.log_softmax(verifier(input_ids=x).logits[0, :-1], -1)
            log_q = torch.log_softmax(drafter(input_ids=x).logits[0, :-1], -1)
            ce += (-(log_p.exp() * log_q).sum(-1)).tolist()
            kl += (log_p.exp() * (log_p - log_q)).sum(-1).tolist()
    return {"ce": sum(ce) / len(ce), "kl": sum(kl) / len(kl)}


# ------------------------------------------------------------------------------------------------ modes, precision
def test_evaluations_run_in_eval_mode_and_every_submodule_gets_its_mode_back():
    verifier, drafter = make_pair(attention_dropout=0.3)
    verifier.train()
    drafter.train()
    drafter.model.layers[0].self_attn.eval()  # a submodule with a mode of its own
    verifier.model.layers[1].eval()
    modes = [m.training for m in (*verifier.modules(), *drafter.modules())]
    tasks = make_tasks()
    expected = {name: by_hand(verifier, drafter, [t[:10] for t in texts[:2]]) for name, texts in tasks.items()}
    result = finetune_drafter(drafter, verifier, tasks, steps=0, eval_fraction=0, eval_examples=2, **SMALL)
    for name, values in expected.items():
        assert result.initial["per_task"][name]["ce"] == pytest.approx(values["ce"], rel=1e-5)
    assert [m.training for m in (*verifier.modules(), *drafter.modules())] == modes


def test_the_history_under_autocast_equals_the_float32_one():
    verifier, drafter = make_pair()
    runs = {flag: finetune_drafter(copy.deepcopy(drafter), verifier, make_tasks(), steps=0, autocast=flag, **SMALL)
            for flag in (False, True)}
    fp32, bf16 = runs[False].initial, runs[True].initial
    for key in ("U_ce", "U_kl", "U_tv", "mean_alpha", "worst_alpha"):
        assert bf16[key] == pytest.approx(fp32[key], rel=1e-6, abs=1e-9), key
    for name in fp32["per_task"]:
        for basis in ("ce", "kl", "tv", "alpha"):
            assert bf16["per_task"][name][basis] == pytest.approx(fp32["per_task"][name][basis], rel=1e-6)


def test_training_steps_under_autocast_take_float32_logits(monkeypatch):
    seen = []
    divergence = finetune_module.divergence

    def record(verifier_logits, drafter_logits, *args, **kwargs):
        seen.append((verifier_logits.dtype, drafter_logits.dtype))
        return divergence(verifier_logits, drafter_logits, *args, **kwargs)

    monkeypatch.setattr(finetune_module, "divergence", record)
    verifier, drafter = make_pair()
    finetune_drafter(drafter, verifier, make_tasks(), steps=2, autocast=True, **SMALL)
    assert seen == [(torch.float32, torch.float32)] * 2


def test_float32_logits_runs_the_head_in_float32_and_puts_it_back():
    model = make_pair()[0]
    x = torch.tensor([[3, 9, 14, 22, 5]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with float32_logits(model):
            out = model(input_ids=x, output_hidden_states=True)
        after = model(input_ids=x).logits
    assert out.logits.dtype == torch.float32 and after.dtype == torch.bfloat16
    head = model.get_output_embeddings()
    assert torch.equal(out.logits, out.hidden_states[-1].float() @ head.weight.t())
    assert "forward" not in vars(head)


# ------------------------------------------------------------------------------------------- characters per token
def test_measured_rho_leaves_out_bos():
    from specdec import data

    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=0)
    drafter = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=1)
    tasks = {"x": ["abcd", "efgh", "ijkl"], "y": ["mnop", "qrst", "uvwx"]}
    result = finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, add_special_tokens=True,
                              per_character=True, steps=0, **{**SMALL, "seq_len": 6})
    assert result.chars_per_token == pytest.approx({"x": 1.0, "y": 1.0})  # 4 characters, 4 tokens and a <bos>


def test_the_per_character_u_covers_every_evaluated_task_or_is_refused():
    verifier, drafter = make_pair()
    tasks = make_tasks()
    eval_tasks = {"a": tasks["a"][:2], "c": [[5, 6, 7, 8, 9, 10]]}  # 'c' is evaluated, not trained on
    with pytest.raises(ValueError, match="evaluated task 'c'.*chars_per_token"):
        finetune_drafter(copy.deepcopy(drafter), verifier, tasks, eval_tasks=eval_tasks, per_character=True,
                         chars_per_token={"a": 2.0, "b": 1.0}, steps=0, **SMALL)
    rho = {"a": 2.0, "b": 1.0, "c": 4.0}
    result = finetune_drafter(copy.deepcopy(drafter), verifier, tasks, eval_tasks=eval_tasks, per_character=True,
                              chars_per_token=rho, steps=0, weight_basis="kl", **SMALL)
    expected = {name: by_hand(verifier, drafter, texts)["kl"] / rho[name] for name, texts in eval_tasks.items()}
    mean = sum(expected.values()) / 2
    assert result.initial["U_char_kl"] == pytest.approx(sum((v - mean) ** 2 for v in expected.values()) / 2,
                                                        rel=1e-4)
    assert result.initial["U"] == result.initial["U_char_kl"]


def test_eval_tasks_are_cut_to_seq_len_like_the_held_out_texts():
    verifier, drafter = make_pair()
    long_text = list(range(3, 33))  # 30 tokens
    result = finetune_drafter(drafter, verifier, make_tasks(), eval_tasks={"a": [long_text]}, steps=0, **SMALL)
    assert result.initial["per_task"]["a"]["ce"] == pytest.approx(by_hand(verifier, drafter, [long_text[:10]])["ce"],
                                                                  rel=1e-5)


# ---------------------------------------------------------------------------------------------------------- resume
def test_a_resume_with_another_vocab_size_or_autocast_is_refused(tmp_path):
    verifier, drafter = make_pair()
    tasks = make_tasks(high=30)
    finetune_drafter(drafter, verifier, tasks, checkpoint_dir=tmp_path, steps=2, **SMALL)
    with pytest.raises(CheckpointError, match=r"different settings \(vocab_size\)"):
        finetune_drafter(drafter, verifier, tasks, checkpoint_dir=tmp_path, steps=4, vocab_size=30, **SMALL)
    with pytest.raises(CheckpointError, match=r"different settings \(autocast\)"):
        finetune_drafter(drafter, verifier, tasks, checkpoint_dir=tmp_path, steps=4, autocast=True, **SMALL)


@pytest.mark.parametrize("change", [{"pad_token_id": 7}, {"backend": "triton"}])
def test_a_resume_may_change_what_changes_no_figure(tmp_path, change):
    """Padding is masked and both backends compute one function: a resumed run with either changed equals the
    uninterrupted run (on the GPU where there is one: the Triton kernels run there, in the interpreter elsewhere)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    verifier, drafter = (model.to(device) for model in make_pair())
    whole = copy.deepcopy(drafter)
    uninterrupted = finetune_drafter(whole, verifier, make_tasks(), steps=3, backend="torch", **SMALL)
    finetune_drafter(drafter, verifier, make_tasks(), steps=2, backend="torch", checkpoint_dir=tmp_path, **SMALL)
    resumed = finetune_drafter(drafter, verifier, make_tasks(), steps=3, checkpoint_dir=tmp_path,
                               **{"backend": "torch", **SMALL, **change})
    assert resumed.resumed_from == 2
    for a, b in zip(whole.parameters(), drafter.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert resumed.final["U_ce"] == pytest.approx(uninterrupted.final["U_ce"], rel=1e-4)


def test_a_resume_with_another_drafter_is_refused(tmp_path):
    verifier, drafter = make_pair()
    start = copy.deepcopy(drafter)
    other = tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=5, init_std=0.3)  # same architecture
    finetune_drafter(drafter, verifier, make_tasks(), steps=2, checkpoint_dir=tmp_path, **SMALL)
    with pytest.raises(CheckpointError, match="another drafter.*weights differ"):
        finetune_drafter(other, verifier, make_tasks(), steps=4, checkpoint_dir=tmp_path, **SMALL)
    wider = tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=1, init_std=0.3, rms_norm_eps=1e-3)
    with pytest.raises(CheckpointError, match="another drafter.*config differ"):
        finetune_drafter(wider, verifier, make_tasks(), steps=4, checkpoint_dir=tmp_path, **SMALL)
    # the drafter the run started from (loaded again) and the one it reached (kept in memory) both resume
    at_step_2 = (tmp_path / CHECKPOINT_NAME).read_bytes()
    for same in (copy.deepcopy(start), copy.deepcopy(drafter)):
        (tmp_path / CHECKPOINT_NAME).write_bytes(at_step_2)
        assert finetune_drafter(same, verifier, make_tasks(), steps=3, checkpoint_dir=tmp_path,
                                **SMALL).resumed_from == 2


def test_checkpoint_files_follow_the_umask(tmp_path):
    verifier, drafter = make_pair()
    previous = os.umask(0o022)
    try:
        finetune_drafter(drafter, verifier, make_tasks(), steps=1, checkpoint_dir=tmp_path, **SMALL)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / CHECKPOINT_NAME).st_mode) == 0o644


# ---------------------------------------------------------------------------------------------- methods and tasks
@pytest.mark.parametrize("settings", [{"method": "scdf"}, {"method": "exact_variance"},
                                      {"method": "exact_variance", "per_character": True}])
def test_a_method_that_trains_nothing_on_one_task_is_refused(settings):
    verifier, drafter = make_pair()
    one = {"a": make_tasks()["a"]}
    extra = {"chars_per_token": {"a": 1.0}} if settings.get("per_character") else {}
    with pytest.raises(ValueError, match=r"needs at least 2 tasks.*'uniform_kd' or 'balanced'"):
        finetune_drafter(drafter, verifier, one, steps=2, **settings, **extra, **SMALL)


@pytest.mark.parametrize("settings", [{"method": "scdf", "weight_floor": 0.5}, {"method": "uniform_kd"},
                                      {"method": "balanced"}])
def test_methods_that_train_on_one_task_run(settings):
    verifier, drafter = make_pair()
    before = copy.deepcopy(drafter)
    finetune_drafter(drafter, verifier, {"a": make_tasks()["a"]}, steps=2, **settings, **SMALL)
    assert not weights_equal(before, drafter)


# --------------------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_saves_a_checkpoint_at_the_step_and_the_same_call_resumes(tmp_path):
    verifier, drafter = make_pair()
    whole = copy.deepcopy(drafter)
    uninterrupted = finetune_drafter(whole, verifier, make_tasks(), steps=5, **{**SMALL, "eval_every": 4})

    def ctrl_c(step, info):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(FinetuneInterrupted) as caught:
        finetune_drafter(drafter, verifier, make_tasks(), steps=5, checkpoint_dir=tmp_path, callback=ctrl_c,
                         **{**SMALL, "eval_every": 4})
    assert isinstance(caught.value, KeyboardInterrupt)
    assert (caught.value.step, caught.value.steps) == (3, 5)
    assert caught.value.checkpoint_path == os.path.join(tmp_path, CHECKPOINT_NAME)
    assert "after step 3 of 5" in str(caught.value) and "resumes" in str(caught.value)
    assert signal.getsignal(signal.SIGINT) is handler
    resumed = finetune_drafter(drafter, verifier, make_tasks(), steps=5, checkpoint_dir=tmp_path,
                               **{**SMALL, "eval_every": 4})
    assert resumed.resumed_from == 3
    for a, b in zip(whole.parameters(), drafter.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [h["step"] for h in resumed.history] == [0, 4, 5]
    assert [h["train_loss"] for h in resumed.history[1:]] == pytest.approx(
        [h["train_loss"] for h in uninterrupted.history[1:]], rel=1e-5)


def test_the_result_prints_without_the_model():
    verifier, drafter = make_pair()
    result = finetune_drafter(drafter, verifier, make_tasks(), steps=1, **SMALL)
    text = repr(result)
    assert text.startswith("FinetuneResult(method='scdf'") and "drafter=LlamaForCausalLM" in text
    assert "Linear" not in text and "Embedding" not in text and len(text) < 400
    assert str(result) == text
