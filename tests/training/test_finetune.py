"""finetune_drafter: frozen verifier, checkpoint/resume, corrupt checkpoints, DDP equivalence, argument checks."""

from __future__ import annotations

import ast
import copy
import dataclasses
import os
import re
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaForCausalLM

from specdec.fairness import unfairness
from specdec.training.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint, save_checkpoint
from specdec.training.finetune import FinetuneConfig, finetune_drafter

from models import tiny_llama as build_tiny_llama

VOCAB = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    return build_tiny_llama(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, seed=seed, init_std=0.3)


def make_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    return tiny_llama(32, 2, seed=0), tiny_llama(16, 1, seed=1)


def make_tasks(seed: int = 0) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": [torch.randint(3, 20, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(10)],
            "b": [torch.randint(20, VOCAB, (12,), generator=gen).tolist() for _ in range(3)]}


SMALL = dict(steps=4, batch_size_per_task=3, seq_len=10, lr=1e-2, eval_every=2, progress=False, seed=0)


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_verifier_frozen_and_greedy_outputs_identical():
    verifier, drafter = make_pair()
    verifier.train()  # its mode must be restored too
    before = copy.deepcopy(verifier)
    flags = [p.requires_grad for p in verifier.parameters()]
    prompt = torch.tensor([[1, 5, 9, 12], [1, 22, 30, 25]])
    with torch.no_grad():
        greedy_before = before.eval().generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    drafter_before = copy.deepcopy(drafter)
    result = finetune_drafter(drafter, verifier, make_tasks(), method="scdf", **SMALL)
    assert weights_equal(verifier, before), "verifier parameters must be bitwise unchanged"
    assert [p.requires_grad for p in verifier.parameters()] == flags
    assert all(p.grad is None for p in verifier.parameters())
    assert verifier.training
    verifier.eval()
    with torch.no_grad():
        greedy_after = verifier.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy_before, greedy_after)
    assert not weights_equal(drafter, drafter_before), "the drafter must have been trained"
    assert [h["step"] for h in result.history] == [0, 2, 4]
    assert result.history[-1]["train_loss"] is not None and len(result.losses) == 4
    for key in ("U", "U_ce", "U_kl", "U_tv", "mean_alpha", "worst_alpha", "worst_task", "per_task"):
        assert key in result.final
    assert set(result.final["per_task"]) == {"a", "b"}


@pytest.mark.parametrize("method", ["uniform_kd", "balanced", "exact_variance"])
def test_baselines_run(method):
    verifier, drafter = make_pair()
    result = finetune_drafter(drafter, verifier, make_tasks(), method=method, weight_basis="tv",
                              **{**SMALL, "steps": 2})
    assert result.method == method and result.steps == 2


def test_config_and_keywords_give_the_same_run():
    settings = {key: value for key, value in SMALL.items() if key != "progress"}
    verifier, drafter0 = make_pair()
    by_keywords, by_config = copy.deepcopy(drafter0), copy.deepcopy(drafter0)
    with_keywords = finetune_drafter(by_keywords, verifier, make_tasks(), method="balanced", weight_basis="kl",
                                     progress=False, **settings)
    config = FinetuneConfig(method="balanced", weight_basis="kl", **settings)
    with_config = finetune_drafter(by_config, verifier, make_tasks(), config=config, progress=False)
    assert weights_equal(by_keywords, by_config) and not weights_equal(by_config, drafter0)
    assert with_keywords.losses == with_config.losses and with_keywords.history == with_config.history
    assert with_keywords.config == with_config.config == config
    assert (with_config.method, with_config.weight_basis) == ("balanced", "kl")


def test_config_keywords_are_checked_by_name():
    verifier, drafter = make_pair()
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'.*did you mean 'steps'"):
        finetune_drafter(drafter, verifier, make_tasks(), stepz=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_speed'.*batch_size_per_task"):
        finetune_drafter(drafter, verifier, make_tasks(), learning_speed=3)
    with pytest.raises(TypeError, match="config= and the setting keyword.*lr, steps"):
        finetune_drafter(drafter, verifier, make_tasks(), config=FinetuneConfig(), steps=3, lr=0.1)
    with pytest.raises(TypeError, match="config must be a FinetuneConfig"):
        finetune_drafter(drafter, verifier, make_tasks(), config={"steps": 3})
    config = FinetuneConfig(steps=3)
    assert config.replace(lr=0.5) == FinetuneConfig(steps=3, lr=0.5) and config.steps == 3
    with pytest.raises(TypeError, match="'seq_length'.*did you mean 'seq_len'"):
        config.replace(seq_length=8)
    with pytest.raises(ValueError, match="lr"):
        config.replace(lr=-1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 4


def test_config_docstring_documents_every_field_with_its_type_and_default():
    attributes = FinetuneConfig.__doc__.split("Attributes:")[1].replace("``", "")
    for f in dataclasses.fields(FinetuneConfig):
        entry = re.search(rf"\n        {f.name} \(([^,]+), default ([^)]+)\): \S", attributes)
        assert entry is not None, f"{f.name} is not documented"
        assert entry.group(1) == f.type and ast.literal_eval(entry.group(2)) == f.default, f.name


def test_scdf_weights_follow_the_basis():
    # the same first minibatch (same seed, same initial drafter) under the three bases: per task KL = CE - H(p) with
    # H(p) > 0, and TV in [0, 1]; the weights are the corrective formula on the basis's own values
    first = {}
    for basis in ("ce", "kl", "tv"):
        verifier, drafter = make_pair()
        seen = []
        finetune_drafter(drafter, verifier, make_tasks(), method="scdf", weight_basis=basis, weight_floor=0.25,
                         callback=lambda step, info, seen=seen: seen.append(info), **{**SMALL, "steps": 2})
        for info in seen:
            values, weights = info["task_values"], info["weights"]
            assert weights == pytest.approx([v - min(values) + 0.25 for v in values], rel=1e-5)
        first[basis] = seen[0]["task_values"]
    ce, kl, tv = (torch.tensor(first[b], dtype=torch.float64) for b in ("ce", "kl", "tv"))
    assert bool((kl >= 0).all()) and bool((kl < ce - 1e-3).all())
    assert bool((tv >= 0).all()) and bool((tv <= 1).all()) and not torch.allclose(tv, kl)


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path):
    verifier, drafter0 = make_pair()
    tasks = make_tasks()
    full = copy.deepcopy(drafter0)
    full_result = finetune_drafter(full, verifier, tasks, checkpoint_dir=tmp_path / "full", **{**SMALL, "steps": 6})

    class StopRunError(Exception):
        pass

    def stop_at_5(step, info):
        if step == 5:
            raise StopRunError

    part = copy.deepcopy(drafter0)
    with pytest.raises(StopRunError):
        finetune_drafter(part, verifier, tasks, checkpoint_dir=tmp_path / "part", callback=stop_at_5,
                         **{**SMALL, "steps": 6})
    assert load_checkpoint(str(tmp_path / "part" / CHECKPOINT_NAME))["meta"]["step"] == 4
    resumed = copy.deepcopy(drafter0)  # a fresh process would start from the initial weights again
    res = finetune_drafter(resumed, verifier, tasks, checkpoint_dir=tmp_path / "part", **{**SMALL, "steps": 6})
    assert res.resumed_from == 4
    assert weights_equal(resumed, full)
    assert [h["step"] for h in res.history] == [h["step"] for h in full_result.history] == [0, 2, 4, 6]
    assert res.final["U"] == pytest.approx(full_result.final["U"], abs=0, rel=0)
    # a finished run resumes to a no-op
    again = copy.deepcopy(drafter0)
    done = finetune_drafter(again, verifier, tasks, checkpoint_dir=tmp_path / "full", **{**SMALL, "steps": 6})
    assert done.losses == [] and weights_equal(again, full)
    # a checkpoint of another configuration is refused, and so is one of other texts (same names and sizes)
    with pytest.raises(CheckpointError, match="different settings"):
        finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path / "full", method="balanced",
                         **{**SMALL, "steps": 6})
    other_texts = {name: [[(t + 1) % VOCAB for t in seq] for seq in seqs] for name, seqs in tasks.items()}
    with pytest.raises(CheckpointError, match="tasks_digest"):
        finetune_drafter(copy.deepcopy(drafter0), verifier, other_texts, checkpoint_dir=tmp_path / "full",
                         **{**SMALL, "steps": 6})


def test_resume_between_evaluations_logs_the_same_train_loss(tmp_path):
    """Checkpoints every 3 steps, evaluations every 4: the steps after the last evaluation are in the checkpoint, so
    the resumed run's logged mean objective equals the uninterrupted run's."""
    verifier, drafter0 = make_pair()
    tasks = make_tasks()
    settings = {**SMALL, "steps": 8, "eval_every": 4, "checkpoint_every": 3}
    full = finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path / "full", **settings)

    class StopRunError(Exception):
        pass

    def stop_at_7(step, info):
        if step == 7:
            raise StopRunError

    with pytest.raises(StopRunError):
        finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path / "part",
                         callback=stop_at_7, **settings)
    assert load_checkpoint(str(tmp_path / "part" / CHECKPOINT_NAME))["meta"]["step"] == 6  # 2 steps after eval 4
    resumed = finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path / "part", **settings)
    assert [h["train_loss"] for h in resumed.history] == [h["train_loss"] for h in full.history]


def _good_checkpoint(tmp_path) -> str:
    verifier, drafter = make_pair()
    finetune_drafter(drafter, verifier, make_tasks(), checkpoint_dir=tmp_path, **{**SMALL, "steps": 2})
    return str(tmp_path / CHECKPOINT_NAME)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_checkpoint_gives_clear_error_and_is_not_overwritten(tmp_path, damage):
    path = _good_checkpoint(tmp_path)
    data = open(path, "rb").read()
    if damage == "flip":
        pos = len(data) - 100
        data = data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = b"not a checkpoint at all"
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CheckpointError, match="corrupt|truncated"):
        load_checkpoint(path)
    verifier, drafter = make_pair()
    with pytest.raises(CheckpointError, match=CHECKPOINT_NAME):
        finetune_drafter(drafter, verifier, make_tasks(), checkpoint_dir=tmp_path, **{**SMALL, "steps": 2})
    assert open(path, "rb").read() == data, "a failing resume must not touch the checkpoint"


def test_failed_save_never_overwrites_a_good_checkpoint(tmp_path, monkeypatch):
    path = _good_checkpoint(tmp_path)
    good = open(path, "rb").read()
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def short_write(tensors, filename, metadata=None):  # simulates a full disk / crash mid-write
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 3)

    monkeypatch.setattr(safetensors.torch, "save_file", short_write)
    verifier, drafter = make_pair()
    optimizer = torch.optim.AdamW(drafter.parameters())
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        save_checkpoint(path, drafter, optimizer, 7, torch.Generator(), [], {})
    assert open(path, "rb").read() == good
    assert os.listdir(tmp_path) == [CHECKPOINT_NAME], "no temporary file may be left behind"
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    load_checkpoint(path)


def test_checkpoint_names_are_importable_from_finetune():
    import specdec.training.checkpoint as checkpoint
    import specdec.training.finetune as finetune

    for name in ("CHECKPOINT_NAME", "CheckpointError", "load_checkpoint", "save_checkpoint"):
        assert getattr(finetune, name) is getattr(checkpoint, name)


def test_cuda_random_states_are_restored_in_device_order():
    """rng.cuda.<index> keys are ordered by the device index as a number (device 10 after device 2)."""
    from specdec.training.checkpoint import CUDA_RNG_PREFIX, cuda_rng_states

    states = {f"{CUDA_RNG_PREFIX}{index}": torch.full((4,), index, dtype=torch.uint8) for index in (10, 2, 0, 11, 1)}
    tensors = {"rng.data": torch.zeros(4, dtype=torch.uint8), "rng.torch": torch.zeros(4, dtype=torch.uint8),
               **states}
    assert [int(state[0]) for state in cuda_rng_states(tensors)] == [0, 1, 2, 10, 11]
    assert cuda_rng_states({"rng.data": torch.zeros(4)}) == []


def test_missing_or_foreign_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope.safetensors"))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(CheckpointError, match="not a specdec"):
        load_checkpoint(str(tmp_path / "foreign.safetensors"))


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        verifier, drafter = make_pair()
        norms = []
        finetune_drafter(drafter, verifier, make_tasks(), method="scdf", checkpoint_dir=out_dir,
                         callback=lambda step, info: norms.append(info["grad_norm"]), **{**SMALL, "steps": 3})
        torch.save({"weights": drafter.state_dict(), "grad_norms": norms}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_match_one_process(tmp_path):
    verifier, single = make_pair()
    norms = []
    finetune_drafter(single, verifier, make_tasks(), method="scdf",
                     callback=lambda step, info: norms.append(info["grad_norm"]), **{**SMALL, "steps": 3})
    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(out_dir)), nprocs=2, join=True)
    outs = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
    ranks = [out["weights"] for out in outs]
    # Adam is almost invariant to a constant gradient scale, so compare the synchronised gradients themselves
    for out in outs:
        assert out["grad_norms"] == pytest.approx(norms, rel=1e-4)
    reference = single.state_dict()
    for name, value in reference.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), "DDP replicas diverged"
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5)
    ckpt = load_checkpoint(str(out_dir / CHECKPOINT_NAME))  # written once, by rank 0
    assert ckpt["meta"]["step"] == 3
    shutil.rmtree(out_dir)


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    (dict(method="sft"), ValueError, "method"),
    (dict(weight_basis="js"), ValueError, "weight_basis"),
    (dict(weight_floor=-0.1), ValueError, "weight_floor"),
    (dict(steps=-1), ValueError, "steps"),
    (dict(batch_size_per_task=0), ValueError, "batch_size_per_task"),
    (dict(seq_len=1), ValueError, "seq_len"),
    (dict(lr=0.0), ValueError, "lr"),
    (dict(lr="fast"), TypeError, "lr"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
    (dict(eval_every=0), ValueError, "eval_every"),
    (dict(tasks=[[1, 2]]), TypeError, "tasks"),
    (dict(tasks={}), ValueError, "tasks"),
    (dict(tasks={"a": ["some text"]}), ValueError, "tokenizer"),
    (dict(tasks={"a": [[3]]}), ValueError, "at least 2 tokens"),
    (dict(tasks={"a": [[3, 4], [3, 99]]}), ValueError, r"tasks\['a'\]\[1\] has token ids outside \[0, 40\)"),
    (dict(vocab_size=VOCAB + 1), ValueError, "vocab_size"),
    (dict(pad_token_id=-1), ValueError, "pad_token_id"),
    (dict(pad_token_id=VOCAB), ValueError, "pad_token_id"),
    (dict(seed=1.5), ValueError, "seed"),
    (dict(eval_fraction=1.0), ValueError, r"eval_fraction must be in \[0, 1\)"),
    (dict(eval_fraction=-0.1), ValueError, "eval_fraction"),
    (dict(split_seed=-1), ValueError, "split_seed"),
    (dict(eval_examples=0), ValueError, "eval_examples"),
    (dict(tasks={"a": [[3, 4, 5]], "b": [[5, 6], [6, 7]]}), ValueError,
     r"tasks\['a'\] has 1 usable text.*eval_tasks=.*eval_fraction=0"),
])
def test_bad_inputs(kwargs, error, needle):
    verifier, drafter = make_pair()
    tasks = kwargs.pop("tasks", make_tasks())
    with pytest.raises(error, match=needle):
        finetune_drafter(drafter, verifier, tasks, progress=False, **kwargs)
    settings = {key: value for key, value in kwargs.items() if key in FinetuneConfig.__dataclass_fields__}
    if settings:
        with pytest.raises(error, match=needle):
            FinetuneConfig(**settings)
    with pytest.raises(ValueError, match="different modules"):
        finetune_drafter(verifier, verifier, make_tasks(), progress=False)
    with pytest.raises(TypeError, match="drafter"):
        finetune_drafter(None, verifier, make_tasks(), progress=False)


def test_drafter_sharing_parameters_with_the_verifier_is_refused():
    """Shared modules would be updated by the drafter's optimizer: the frozen verifier would change."""
    verifier = tiny_llama(16, 2, seed=0)
    drafter = tiny_llama(16, 1, seed=1)
    drafter.lm_head = verifier.lm_head
    before = copy.deepcopy(verifier.state_dict())
    with pytest.raises(ValueError, match="shares parameters with the verifier.*lm_head"):
        finetune_drafter(drafter, verifier, make_tasks(), **SMALL)
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items())
    frozen = tiny_llama(16, 1, seed=1).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        finetune_drafter(frozen, verifier, make_tasks(), **SMALL)


# -------------------------------------------------------------------------------------------- held-out evaluation
def _record_batches_and_evaluations(monkeypatch) -> tuple[list[list[int]], list[dict[str, list[list[int]]]]]:
    """Patch the minibatch drawer and the evaluation to record every training window and every evaluation set."""
    import specdec.training.finetune as finetune_module

    windows: list[list[int]] = []
    evaluated: list[dict[str, list[list[int]]]] = []
    draw, evaluate = finetune_module._draw_global_batch, finetune_module._evaluate

    def recording_draw(*args, **kwargs):
        rows = draw(*args, **kwargs)
        windows.extend(row[1] for row in rows)
        return rows

    def recording_evaluate(verifier, drafter, eval_tokens, *args, **kwargs):
        evaluated.append(eval_tokens)
        return evaluate(verifier, drafter, eval_tokens, *args, **kwargs)

    monkeypatch.setattr(finetune_module, "_draw_global_batch", recording_draw)
    monkeypatch.setattr(finetune_module, "_evaluate", recording_evaluate)
    return windows, evaluated


def test_evaluation_texts_are_held_out_from_training_by_default(monkeypatch):
    """Without eval_tasks, a seeded tenth of every task (at least one text) is evaluated on and never trained on."""
    windows, evaluated = _record_batches_and_evaluations(monkeypatch)
    tasks = make_tasks()  # "a": 10 texts, "b": 3 texts; every text at most 14 tokens, so a window is a whole text
    verifier, drafter = make_pair()
    result = finetune_drafter(drafter, verifier, tasks, **{**SMALL, "seq_len": 16, "steps": 6})
    assert {task: len(indices) for task, indices in result.held_out.items()} == {"a": 1, "b": 1}
    held = {task: [tasks[task][i] for i in indices] for task, indices in result.held_out.items()}
    assert all(evaluation == held for evaluation in evaluated) and len(evaluated) == len(result.history)
    trained = {tuple(window) for window in windows}
    assert not trained & {tuple(text) for texts in held.values() for text in texts}, "a held-out text was trained on"
    rest = {tuple(text) for task, texts in tasks.items() for i, text in enumerate(texts)
            if i not in result.held_out[task]}
    assert trained <= rest and len(trained) > len(rest) // 2


def test_the_held_out_split_is_seeded_and_documented(monkeypatch):
    from specdec.training.finetune import held_out_split

    sizes = {"a": 250, "b": 10, "c": 2}
    split = held_out_split(sizes, eval_fraction=0.1, max_examples=32, seed=0)
    assert {task: len(indices) for task, indices in split.items()} == {"a": 25, "b": 1, "c": 1}
    assert split == held_out_split(sizes, 0.1, 32, 0), "the same seed gives the same split"
    assert split["a"] != held_out_split(sizes, 0.1, 32, 1)["a"]
    assert held_out_split({"a": 250}, 0.1, 32, 0)["a"] == split["a"], "a task's split does not depend on the others"
    assert len(held_out_split({"a": 250}, 0.5, 32, 0)["a"]) == 32, "at most max_examples"
    assert all(indices == sorted(set(indices)) and max(indices) < sizes[task] for task, indices in split.items())
    with pytest.raises(ValueError, match=r"tasks\['c'\] has 1 usable text"):
        held_out_split({"c": 1})
    with pytest.raises(ValueError, match="eval_fraction"):
        held_out_split({"a": 5}, eval_fraction=0.0)
    # the split follows split_seed, not the training seed, so that training seeds share one evaluation set
    verifier, drafter0 = make_pair()
    runs = {}
    for seed, split_seed in ((0, 0), (1, 0), (0, 7)):
        runs[seed, split_seed] = finetune_drafter(copy.deepcopy(drafter0), verifier, make_tasks(),
                                                  **{**SMALL, "steps": 1, "seed": seed, "split_seed": split_seed,
                                                     "eval_fraction": 0.3}).held_out
    assert runs[0, 0] == runs[1, 0] != runs[0, 7]
    assert "held out" in FinetuneConfig.__doc__ and "eval_fraction" in finetune_drafter.__doc__


def test_eval_fraction_zero_and_eval_tasks_evaluate_on_what_they_name(monkeypatch):
    _, evaluated = _record_batches_and_evaluations(monkeypatch)
    tasks = make_tasks()
    verifier, drafter0 = make_pair()
    on_training = finetune_drafter(copy.deepcopy(drafter0), verifier, tasks,
                                   **{**SMALL, "steps": 1, "eval_fraction": 0.0, "eval_examples": 2})
    assert on_training.held_out is None
    assert evaluated[-1] == {task: [text[:SMALL["seq_len"]] for text in texts[:2]] for task, texts in tasks.items()}
    given = {"a": [[5, 6, 7]], "b": [[30, 31]]}
    with_eval_tasks = finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, eval_tasks=given,
                                       **{**SMALL, "steps": 1})
    assert with_eval_tasks.held_out is None and evaluated[-1] == given


# ------------------------------------------------------------------------------------ models and data that don't fit
def test_differing_output_sizes_need_vocab_size():
    verifier = build_tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=VOCAB + 24, hidden_size=16, num_layers=1, seed=1)
    with pytest.raises(ValueError, match=rf"the drafter has {VOCAB + 24} output rows.*pass vocab_size={VOCAB}"):
        finetune_drafter(drafter, verifier, make_tasks(), **SMALL)
    result = finetune_drafter(drafter, verifier, make_tasks(), vocab_size=VOCAB, **{**SMALL, "steps": 1})
    assert result.steps == 1


def test_windows_longer_than_the_models_positions_are_refused():
    from specdec.training.finetune import check_seq_len

    verifier, drafter = make_pair()
    drafter.config.max_position_embeddings = 8
    message = r"seq_len 10 is more than the models' 8 positions \(max_position_embeddings\): use 8 or less"
    with pytest.raises(ValueError, match=message):
        check_seq_len(10, verifier, drafter)
    with pytest.raises(ValueError, match=message):
        finetune_drafter(drafter, verifier, make_tasks(), **SMALL)
    assert check_seq_len(8, verifier, drafter) == 8
    with pytest.raises(ValueError, match="seq_len must be an integer >= 2"):
        check_seq_len(1, verifier, drafter)


def test_every_text_is_tokenized_once(monkeypatch):
    """The split, the unknown-token check, the characters per token and the training share one encoding."""
    from collections import Counter

    from specdec import data

    tokenizer = data.build_char_tokenizer()
    encoded = Counter()
    cls = type(tokenizer)
    encode, call = cls.encode, cls.__call__

    def counting_encode(self, text, *args, **kwargs):
        encoded[text] += 1
        return encode(self, text, *args, **kwargs)

    def counting_call(self, text, *args, **kwargs):
        encoded.update([text] if isinstance(text, str) else text)
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(cls, "encode", counting_encode)
    monkeypatch.setattr(cls, "__call__", counting_call)
    verifier = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=1)
    tasks = {"short": [f"{i}+{i}={2 * i};" for i in range(6)], "long": [f"the fox sees {i} birds." for i in range(6)]}
    eval_tasks = {"short": ["9+9=18;"], "long": ["a cat sees a bird."]}
    finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, per_character=True, **{**SMALL, "steps": 1})
    assert encoded == Counter(text for texts in tasks.values() for text in texts)
    encoded.clear()
    finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, eval_tasks=eval_tasks, per_character=True,
                     **{**SMALL, "steps": 1})
    assert encoded == Counter(text for group in (tasks, eval_tasks) for texts in group.values() for text in texts)


def test_texts_the_tokenizer_does_not_cover_are_named():
    from specdec import data
    from specdec.compat import SpecdecWarning

    tokenizer = data.build_char_tokenizer()
    verifier = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=1)
    tasks = {"latin": ["the fox sees a bird."] * 4, "bengali": ["\u0986\u09ae\u09bf \u09ad\u09be\u09a4 12"] * 4}
    with pytest.warns(SpecdecWarning) as record:
        finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, **{**SMALL, "steps": 1})
    messages = [str(w.message) for w in record if issubclass(w.category, SpecdecWarning)]
    assert len(messages) == 1 and messages[0].startswith("task 'bengali': 60.0% of its 40 tokens are '<unk>'")


# -------------------------------------------------------------------------------------------- per-character weights
def test_per_character_weights_follow_the_formula_on_a_constructed_minibatch():
    from types import SimpleNamespace

    from specdec.training.finetune import _step_weights

    # three tasks; per token: CE, KL, TV; task 2 has one token
    task_ids = torch.tensor([0, 0, 1, 1, 1, 2])
    ce = torch.tensor([2.0, 3.0, 1.0, 2.0, 3.0, 4.0])
    kl = torch.tensor([0.4, 0.6, 0.3, 0.9, 1.2, 0.5])
    tv = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.2, 0.4])
    div = SimpleNamespace(cross_entropy=ce, kl=kl, tv=tv)
    rho = torch.tensor([1.0, 3.0, 1.25], dtype=torch.float64)
    counts = torch.tensor([2.0, 3.0, 1.0], dtype=torch.float64)
    d = torch.tensor([0.5, 0.8, 0.5], dtype=torch.float64)  # per-task mean KL
    k = torch.tensor([2.5, 2.0, 4.0], dtype=torch.float64)  # per-task mean CE
    cfg = FinetuneConfig(method="scdf", weight_basis="kl", per_character=True)
    token_weights, weights, values, objective = _step_weights(cfg, task_ids, div, 3, False, rho)
    expected = d / rho - (d / rho).min()  # 0.5, 0.2667, 0.4 -> 0.2333, 0, 0.1333
    torch.testing.assert_close(values, d / rho)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(token_weights.double(), (expected / rho / counts)[task_ids], rtol=1e-6, atol=1e-7)
    assert objective == pytest.approx(float((expected * k / rho).sum()), rel=1e-6)
    floored = _step_weights(cfg.replace(weight_floor=0.1), task_ids, div, 3, False, rho)[1]
    torch.testing.assert_close(floored.double(), expected + 0.1, rtol=1e-6, atol=1e-7)
    exact = _step_weights(cfg.replace(method="exact_variance"), task_ids, div, 3, False, rho)[1]
    torch.testing.assert_close(exact.double(), d / rho - (d / rho).mean(), rtol=1e-6, atol=1e-7)
    # per token the same minibatch pulls task 1 hardest; per character task 0 (task 1 has 3 characters a token)
    per_token = _step_weights(cfg.replace(per_character=False), task_ids, div, 3, False, rho)[1]
    torch.testing.assert_close(per_token.double(), d - d.min(), rtol=1e-6, atol=1e-7)
    assert int(per_token.argmax()) == 1 and int(weights.argmax()) == 0


def _first_steps(chars_per_token, per_character, steps=2):
    verifier, drafter = make_pair()
    seen = []
    result = finetune_drafter(drafter, verifier, make_tasks(), method="scdf", weight_basis="kl",
                              per_character=per_character, chars_per_token=chars_per_token,
                              callback=lambda step, info: seen.append(info), **{**SMALL, "steps": steps})
    return drafter, seen, result


def test_per_character_changes_the_update_only_when_rho_differs():
    per_token, token_info, _ = _first_steps(None, False)
    ones, ones_info, _ = _first_steps({"a": 1.0, "b": 1.0}, True)
    assert weights_equal(per_token, ones), "rho = 1 everywhere is the per-token objective"
    assert [i["weights"] for i in ones_info] == [i["weights"] for i in token_info]
    rho = {"a": 1.0, "b": 4.0}
    drafter, info, result = _first_steps(rho, True)
    assert not weights_equal(per_token, drafter), "differing rho must change the update"
    first = info[0]  # the same first minibatch and drafter as the per-token run
    assert first["chars_per_token"] == [1.0, 4.0]
    per_token_values = token_info[0]["task_values"]
    assert first["task_values"] == pytest.approx([per_token_values[0] / 1.0, per_token_values[1] / 4.0])
    values = first["task_values"]
    assert first["weights"] == pytest.approx([v - min(values) for v in values], rel=1e-5, abs=1e-7)
    assert result.chars_per_token == rho and result.config.per_character
    entry = result.final
    assert entry["U"] == entry["U_char_kl"]
    per_task = entry["per_task"]
    assert entry["U_char_kl"] == pytest.approx(unfairness([per_task[n]["kl"] / rho[n] for n in ("a", "b")]))


def test_per_character_measures_rho_on_the_texts_and_names_what_it_lacks():
    from specdec import data

    tokenizer = data.build_char_tokenizer()
    verifier = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=1)
    tasks = {"short": ["12+3=15;", "4+4=8;", "7+1=8;"], "long": ["the red fox sees a bird.", "a cat.", "no wolf."]}
    result = finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, add_special_tokens=True,
                              per_character=True, **{**SMALL, "steps": 1})
    # one token per character, and <bos> is no text: rho = 1
    for name in tasks:
        assert result.chars_per_token[name] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="per_character=True needs the characters per token of task 'a'"):
        finetune_drafter(*make_pair()[::-1], make_tasks(), per_character=True, **SMALL)
    with pytest.raises(ValueError, match=r"chars_per_token has no entry for task\(s\) 'b'"):
        finetune_drafter(*make_pair()[::-1], make_tasks(), per_character=True, chars_per_token={"a": 2.0}, **SMALL)
    with pytest.raises(ValueError, match=r"chars_per_token\['b'\]"):
        finetune_drafter(*make_pair()[::-1], make_tasks(), chars_per_token={"a": 2.0, "b": 0.0}, **SMALL)
    with pytest.raises(TypeError, match="chars_per_token must be a mapping"):
        finetune_drafter(*make_pair()[::-1], make_tasks(), chars_per_token=[2.0, 1.0], **SMALL)
    with pytest.raises(ValueError, match="per_character=True reweights the tasks of method 'scdf' or"):
        FinetuneConfig(method="uniform_kd", per_character=True)
    with pytest.raises(TypeError, match="per_character must be True or False"):
        FinetuneConfig(per_character="yes")


def test_a_per_token_checkpoint_is_not_resumed_per_character(tmp_path):
    verifier, drafter = make_pair()
    finetune_drafter(drafter, verifier, make_tasks(), checkpoint_dir=tmp_path, **{**SMALL, "steps": 2})
    with pytest.raises(CheckpointError, match="different settings.*chars_per_token, per_character"):
        finetune_drafter(drafter, verifier, make_tasks(), checkpoint_dir=tmp_path, per_character=True,
                         chars_per_token={"a": 1.0, "b": 2.0}, **{**SMALL, "steps": 3})


def test_characters_are_counted_only_when_rho_is_measured(monkeypatch):
    """Token-id texts are decoded to count characters only with per_character and no chars_per_token."""
    from specdec import data

    tokenizer = data.build_char_tokenizer()
    cls = type(tokenizer)
    decode, decoded = cls.decode, []

    def counting_decode(self, ids, *args, **kwargs):
        decoded.append(list(ids))
        return decode(self, ids, *args, **kwargs)

    texts = {"short": ["12+3=15;", "4+4=8;", "7+1=8;"], "long": ["the red fox sees a bird.", "a cat.", "no wolf."]}
    tasks = {name: [tokenizer.encode(t) for t in group] for name, group in texts.items()}
    monkeypatch.setattr(cls, "decode", counting_decode)
    verifier = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, seed=1)
    run = {**SMALL, "steps": 1, "eval_fraction": 0}
    per_token = finetune_drafter(copy.deepcopy(drafter), verifier, tasks, tokenizer=tokenizer, **run)
    assert decoded == [] and per_token.chars_per_token is None and "U_char_ce" not in per_token.final
    given = {"short": 1.0, "long": 2.0}
    with_given = finetune_drafter(copy.deepcopy(drafter), verifier, tasks, tokenizer=tokenizer, per_character=True,
                                  chars_per_token=given, **run)
    assert decoded == [] and with_given.chars_per_token == given
    measured = finetune_drafter(copy.deepcopy(drafter), verifier, tasks, tokenizer=tokenizer, per_character=True,
                                **run)
    assert sorted(map(tuple, decoded)) == sorted(tuple(ids) for group in tasks.values() for ids in group)
    for name in texts:  # one token per character, the <bos> of encode() no text: rho = 1
        assert measured.chars_per_token[name] == pytest.approx(1.0)
    assert measured.final["U"] == measured.final["U_char_ce"]


def test_differing_output_sizes_are_reported_as_evaluate_reports_them():
    from specdec import data
    from specdec.compat import shared_vocab_size

    tokenizer = data.build_char_tokenizer()
    verifier = build_tiny_llama(vocab_size=len(tokenizer) + 8, hidden_size=16, num_layers=1, seed=0)
    drafter = build_tiny_llama(vocab_size=len(tokenizer) + 24, hidden_size=16, num_layers=1, seed=1)
    with pytest.raises(ValueError) as expected:
        shared_vocab_size(verifier, drafter, tokenizer=tokenizer)
    assert f"pass vocab_size={len(tokenizer)} (the tokenizer has {len(tokenizer)} tokens)" in str(expected.value)
    tasks = {"a": ["12+3=15;", "4+4=8;"], "b": ["the fox.", "a cat."]}
    with pytest.raises(ValueError) as got:
        finetune_drafter(drafter, verifier, tasks, tokenizer=tokenizer, **SMALL)
    assert str(got.value) == str(expected.value)


def test_a_checkpoint_from_before_per_character_resumes_per_token_only(tmp_path):
    """A checkpoint whose settings lack per_character and chars_per_token was a per-token run: it resumes one exactly
    and is refused to a per-character run."""
    import json

    from safetensors.torch import save_file

    from specdec.training.checkpoint import weights_digest

    verifier, drafter0 = make_pair()
    tasks = make_tasks()
    full = copy.deepcopy(drafter0)
    finetune_drafter(full, verifier, tasks, **SMALL)
    finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path, **{**SMALL, "steps": 2})
    path = str(tmp_path / CHECKPOINT_NAME)
    ckpt = load_checkpoint(path)
    meta = ckpt["meta"]
    assert meta["config"].pop("per_character") is False and meta["config"].pop("chars_per_token") is None
    meta_json = json.dumps(meta, sort_keys=True)
    save_file(ckpt["tensors"], path, metadata={"specdec": meta_json, "sha256": weights_digest(ckpt["tensors"],
                                                                                              meta_json)})
    with pytest.raises(CheckpointError, match=r"different settings \(chars_per_token, per_character\); use another"):
        finetune_drafter(copy.deepcopy(drafter0), verifier, tasks, checkpoint_dir=tmp_path, per_character=True,
                         chars_per_token={"a": 1.0, "b": 2.0}, **SMALL)
    assert "per_character" not in load_checkpoint(path)["meta"]["config"], "a refused resume leaves the file alone"
    resumed = copy.deepcopy(drafter0)
    result = finetune_drafter(resumed, verifier, tasks, checkpoint_dir=tmp_path, **SMALL)
    assert result.resumed_from == 2 and [h["step"] for h in result.history] == [0, 2, 4]
    assert weights_equal(resumed, full)
