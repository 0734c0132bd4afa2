"""Drafter-only finetuning that lowers the disparity of speculative decoding across tasks (s-CDF and baselines).

Each step draws a global minibatch of text windows, runs the frozen verifier (no grad) and the drafter on it, and
minimises a weighted distillation loss ``sum_n omega_n H(p_n, q_n)`` through
:func:`specdec.divergences.divergence_loss` (fused Triton kernel on CUDA). The methods differ only in the sampling
and in ``omega`` (``K_i``: task i's mean CE on the minibatch, ``N_i`` its token count, ``N`` the total):

* ``"scdf"``: ``batch_size_per_task`` windows of every task; ``omega_n = w_i / N_i`` with corrective weights
  ``w_i = v_i - min_j v_j + weight_floor`` computed on ``weight_basis`` v in {CE, KL, TV} (see :mod:`specdec.losses`).
* ``"exact_variance"``: the same with ``w_i = v_i - vbar``, i.e. gradient descent on U itself (levels down).
* ``"balanced"``: equal task sampling, ``w_i = 1`` (the sum of the per-task means, m times their mean: the logged
  loss and the gradient are m times those of a mean).
* ``"uniform_kd"``: DistillSpec-style KD on the natural mixture: ``batch_size_per_task * m`` windows drawn uniformly
  from the pooled texts, ``omega_n = 1 / N``.

Under ``torch.distributed`` (e.g. ``torchrun``) the drafter is wrapped in DDP; every process draws the same global
minibatch and keeps its slice (rows ``rank::world_size``), per-task sums and counts are all-reduced before the weights
are computed, and each process backpropagates ``world_size * sum_{n local} omega_n H_n``, so the DDP gradient average
equals the one-process gradient of the global objective.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec._models import check_model_pair, model_device, model_vocab_size
from specdec.fairness import unfairness
from specdec.losses import scdf_weights, token_weights_unchecked
from specdec.teacher_forcing import encode_items, pad_batch, prefix_logits, prefix_rows, task_divergences

METHODS = ("scdf", "exact_variance", "uniform_kd", "balanced")
WEIGHT_BASES = ("ce", "kl", "tv")
CHECKPOINT_NAME = "drafter_checkpoint.safetensors"
_FORMAT = "specdec-finetune-v1"


class CheckpointError(ValueError):
    """A checkpoint file is missing pieces, truncated, corrupt or from a different run configuration."""


@dataclass
class FinetuneResult:
    """Result of :func:`finetune_drafter`.

    drafter: the (in-place updated) drafter. history: one dict per evaluation (step 0 first, the final step last)
    with ``step``, ``U`` (on the weight basis), ``U_ce``, ``U_kl``, ``U_tv``, ``mean_alpha``, ``worst_alpha``,
    ``worst_task``, ``per_task`` (name -> ``{"ce", "kl", "tv", "alpha"}``) and ``train_loss`` (mean objective since
    the previous evaluation). losses: the objective of every step run in this call. steps: the last step reached.
    resumed_from: the step loaded from a checkpoint (0 when starting fresh). checkpoint_path: the checkpoint file.
    """

    drafter: torch.nn.Module
    history: list[dict[str, Any]]
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    method: str = "scdf"
    weight_basis: str = "ce"
    resumed_from: int = 0
    checkpoint_path: str | None = None

    @property
    def initial(self) -> dict[str, Any]:
        return self.history[0]

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]


# ------------------------------------------------------------------------------------------------- checkpoints
def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(tensors: Mapping[str, torch.Tensor], meta_json: str) -> str:
    h = hashlib.sha256(meta_json.encode())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _tasks_digest(corpus: list[list[list[int]]], eval_tokens: dict[str, list[list[int]]]) -> str:
    """SHA-256 of the training and evaluation token ids: a resume with other data (same names, same sizes) is
    refused."""
    h = hashlib.sha256()
    for part in (corpus, sorted(eval_tokens.items())):
        h.update(json.dumps(part, separators=(",", ":")).encode("ascii"))
    return h.hexdigest()


def save_checkpoint(path: str, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_generator: torch.Generator, history: list[dict[str, Any]], config: dict[str, Any],
                    since_eval: list[float] | None = None) -> None:
    """Atomically write a safetensors checkpoint: drafter weights, AdamW state, step, RNG states, history, config,
    and the objectives of the steps since the last evaluation (so a resumed run logs the same ``train_loss``).

    The file is written to a temporary file in the same folder, read back and verified (SHA-256 over every tensor and
    the metadata), and only then moved over ``path`` with ``os.replace``; a failure at any point leaves the previous
    checkpoint untouched.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, value in drafter.state_dict().items():
        tensors[f"drafter.{name}"] = value.detach().cpu().clone().contiguous()
    opt_state = optimizer.state_dict()
    scalar_state: dict[str, dict[str, Any]] = {}
    for index, state in opt_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().clone().contiguous()
            else:
                scalar_state.setdefault(str(index), {})[key] = value
    tensors["rng.data"] = data_generator.get_state().clone()
    tensors["rng.torch"] = torch.get_rng_state().clone()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state.clone()
    meta = {"format": _FORMAT, "step": step, "param_groups": opt_state["param_groups"], "scalar_state": scalar_state,
            "history": history, "config": config, "since_eval": list(since_eval or [])}
    meta_json = json.dumps(meta, sort_keys=True)
    metadata = {"specdec": meta_json, "sha256": _digest(tensors, meta_json)}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        load_checkpoint(tmp)  # verify what actually reached the disk before it replaces anything
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Returns ``{"tensors": {...}, "meta": {...}}``. Raises :class:`CheckpointError` (a ValueError) naming the file when
    it is missing, truncated, not a safetensors file, not a specdec checkpoint, or its checksum does not match.
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for bad headers and short files
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated (cannot be read as safetensors: {exc}); "
                              "delete it or point checkpoint_dir elsewhere") from exc
    if "specdec" not in metadata or "sha256" not in metadata:
        raise CheckpointError(f"checkpoint {path} is not a specdec finetuning checkpoint (metadata missing)")
    if _digest(tensors, metadata["specdec"]) != metadata["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 checksum does not match its contents")
    meta = json.loads(metadata["specdec"])
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, expected {_FORMAT!r}")
    return {"tensors": tensors, "meta": meta}


def _restore(ckpt: dict[str, Any], drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
             data_generator: torch.Generator, path: str) -> None:
    tensors, meta = ckpt["tensors"], ckpt["meta"]
    weights = {k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")}
    own = drafter.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise CheckpointError(f"checkpoint {path} holds weights of a different drafter architecture")
    drafter.load_state_dict(weights)
    device = model_device(drafter)
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalar_state"].items():
        state.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    for param_state in optimizer.state.values():  # load_state_dict casts to the param dtype; keep the device too
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                param_state[name] = value.to(device)
    data_generator.set_state(tensors["rng.data"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda_states = [tensors[k] for k in sorted(t for t in tensors if t.startswith("rng.cuda."))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])


# ------------------------------------------------------------------------------------------------------- data
def _tokenize_tasks(tasks: object, tokenizer: Any, name: str,
                    add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
    if not isinstance(tasks, Mapping):
        raise TypeError(f"{name} must be a mapping from task name to a list of texts or token-id lists, "
                        f"got {type(tasks).__name__}")
    if len(tasks) == 0:
        raise ValueError(f"{name} must contain at least one task")
    out: dict[str, list[list[int]]] = {}
    for task, items in tasks.items():
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"{name}[{task!r}] must be a list of texts or token-id lists, got {type(items).__name__}")
        tokens, _ = encode_items(items, tokenizer, f"{name}[{task!r}]", add_special_tokens)
        tokens = [t for t in tokens if len(t) >= 2]
        if not tokens:
            raise ValueError(f"{name}[{task!r}] has no text of at least 2 tokens")
        out[str(task)] = tokens
    return out


def _window(seq: list[int], seq_len: int, generator: torch.Generator) -> list[int]:
    if len(seq) <= seq_len:
        return seq
    start = int(torch.randint(0, len(seq) - seq_len + 1, (1,), generator=generator))
    return seq[start:start + seq_len]


def _draw_global_batch(method: str, corpus: list[list[list[int]]], batch_size_per_task: int, seq_len: int,
                       generator: torch.Generator) -> list[tuple[int, list[int]]]:
    """(task index, token window) rows of one global minibatch; identical on every process (same generator)."""
    rows: list[tuple[int, list[int]]] = []
    if method == "uniform_kd":
        pooled = [(i, j) for i, seqs in enumerate(corpus) for j in range(len(seqs))]
        picks = torch.randint(0, len(pooled), (batch_size_per_task * len(corpus),), generator=generator).tolist()
        for p in picks:
            i, j = pooled[p]
            rows.append((i, _window(corpus[i][j], seq_len, generator)))
    else:
        for i, seqs in enumerate(corpus):
            picks = torch.randint(0, len(seqs), (batch_size_per_task,), generator=generator).tolist()
            rows += [(i, _window(seqs[j], seq_len, generator)) for j in picks]
    return rows


# ------------------------------------------------------------------------------------------------- evaluation
def _evaluate(verifier: torch.nn.Module, drafter: torch.nn.Module, eval_tokens: dict[str, list[list[int]]],
              weight_basis: str, temperature: float, vocab_size: int, batch_size: int, backend: str,
              autocast: bool) -> dict[str, Any]:
    was_training = drafter.training
    drafter.eval()
    device = model_device(drafter)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
        divs = task_divergences(verifier, drafter, eval_tokens, batch_size=batch_size, temperature=temperature,
                                backend=backend, vocab_size=vocab_size)
    drafter.train(was_training)
    per_task = {}
    for name, div in divs.items():
        m = div.means()
        per_task[name] = {"ce": m["cross_entropy"], "kl": m["kl"], "tv": m["tv"], "alpha": m["alpha"]}
    alphas = {n: v["alpha"] for n, v in per_task.items()}
    worst = min(alphas, key=alphas.get)
    entry = {f"U_{b}": unfairness([v[b] for v in per_task.values()]) for b in WEIGHT_BASES}
    entry.update({"U": entry[f"U_{weight_basis}"], "mean_alpha": sum(alphas.values()) / len(alphas),
                  "worst_alpha": alphas[worst], "worst_task": worst, "per_task": per_task})
    return entry


# -------------------------------------------------------------------------------------------------- training
def _check_int(value: object, name: str, minimum: int, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


def _check_float(value: object, name: str, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {value}")
    return value


def finetune_drafter(
    drafter: torch.nn.Module,
    verifier: torch.nn.Module,
    tasks: Mapping[str, Sequence[str] | Sequence[list[int]]],
    *,
    tokenizer: Any = None,
    method: str = "scdf",
    weight_basis: str = "ce",
    weight_floor: float = 0.0,
    steps: int = 200,
    batch_size_per_task: int = 8,
    seq_len: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    temperature: float = 1.0,
    eval_every: int | None = 50,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = True,
    seed: int = 0,
    progress: bool = True,
    eval_tasks: Mapping[str, Sequence[str] | Sequence[list[int]]] | None = None,
    eval_examples: int = 32,
    normalize_weights: bool = False,
    backend: str = "auto",
    autocast: bool | None = None,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    add_special_tokens: bool = False,
) -> FinetuneResult:
    """Finetune ``drafter`` in place toward ``verifier`` with s-CDF or a baseline; the verifier is never modified.

    Args:
        drafter: HF causal LM to train (its parameters are updated in place; its train/eval mode is restored).
        verifier: HF causal LM on the same device; run in eval mode under no_grad, its parameters untouched.
        tasks: name -> list of texts (needs ``tokenizer``) or of token-id lists; the training data of each task.
        method: "scdf" | "exact_variance" | "uniform_kd" | "balanced" (see the module docstring).
        weight_basis: "ce" | "kl" | "tv": per-task values the s-CDF / exact-variance weights are computed on.
        weight_floor: >= 0 added to the corrective weights (``method="scdf"``).
        steps: total optimizer steps (a resumed run continues up to this number).
        batch_size_per_task: windows per task per step (global, over all processes); uniform_kd draws
            ``batch_size_per_task * m`` windows from the pooled texts.
        seq_len: window length in tokens (>= 2; longer texts are cropped at a random offset).
        lr, weight_decay: AdamW. max_grad_norm: gradient clipping (None = off). temperature: > 0 for p and q.
        eval_every: evaluate U, alpha etc. on the eval set every this many steps (and at the start and the end);
            None evaluates only at the start and the end.
        checkpoint_dir: folder for ``drafter_checkpoint.safetensors`` (None = no checkpoints);
            checkpoint_every: steps between checkpoints (default ``eval_every``); one is always written at the end.
        resume: continue from the checkpoint in ``checkpoint_dir`` when there is one (a corrupt one raises
            :class:`CheckpointError` instead of being overwritten); ``resume=False`` starts afresh and replaces it at
            the first save.
        seed: seeds the minibatch sampler. progress: tqdm bar (rank 0 only).
        eval_tasks: held-out texts for the evaluations (default: the first ``eval_examples`` texts of each task,
            cropped to ``seq_len``).
        normalize_weights: divide the per-task weights by ``sum |w_i|``.
        backend: divergence kernel backend. autocast: bf16 autocast (default: on CUDA only).
        pad_token_id: id used to right-pad windows (masked out). vocab_size: shared id range of the two models.
        callback: called as ``callback(step, info)`` after every step (info has ``loss``, ``weights``,
            ``task_values`` and ``grad_norm``, the global gradient norm before clipping).
        add_special_tokens: passed to ``tokenizer.encode`` for string texts (e.g. to prepend BOS).

    Returns:
        :class:`FinetuneResult`.
    """
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from specdec._validation import check_backend, check_int_range
    from specdec.divergences import divergence, divergence_loss

    check_model_pair(verifier, drafter)
    if verifier is drafter:
        raise ValueError("drafter and verifier must be different modules (the verifier is frozen)")
    verifier_storage = {p.untyped_storage().data_ptr() for p in verifier.parameters()}
    shared = [name for name, p in drafter.named_parameters() if p.untyped_storage().data_ptr() in verifier_storage]
    if shared:
        raise ValueError(f"drafter shares parameters with the verifier ({', '.join(shared[:4])}"
                         f"{', ...' if len(shared) > 4 else ''}): finetuning would modify the frozen verifier; give "
                         "the drafter its own copies")
    if not any(p.requires_grad for p in drafter.parameters()):
        raise ValueError("drafter has no parameter with requires_grad=True: nothing to finetune")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if weight_basis not in WEIGHT_BASES:
        raise ValueError(f"weight_basis must be one of {WEIGHT_BASES}, got {weight_basis!r}")
    weight_floor = _check_float(weight_floor, "weight_floor", 0.0)
    _check_int(steps, "steps", 0)
    _check_int(batch_size_per_task, "batch_size_per_task", 1)
    _check_int(seq_len, "seq_len", 2)
    _check_int(eval_every, "eval_every", 1, allow_none=True)
    _check_int(checkpoint_every, "checkpoint_every", 1, allow_none=True)
    _check_int(eval_examples, "eval_examples", 1)
    lr = _check_float(lr, "lr", 0.0, strict=True)
    weight_decay = _check_float(weight_decay, "weight_decay", 0.0)
    if max_grad_norm is not None:
        max_grad_norm = _check_float(max_grad_norm, "max_grad_norm", 0.0, strict=True)
    temperature = _check_float(temperature, "temperature", 0.0, strict=True)
    check_backend(backend)
    device = model_device(drafter)
    if model_device(verifier) != device:
        raise ValueError(f"verifier is on {model_device(verifier)} but drafter is on {device}: use one device")
    model_vocab = min(model_vocab_size(verifier), model_vocab_size(drafter))
    if vocab_size is None:
        vocab_size = model_vocab
    else:
        check_int_range(vocab_size, "vocab_size", 1, model_vocab + 1, note=" (the models' output sizes)")
    check_int_range(pad_token_id, "pad_token_id", 0, vocab_size)
    check_int_range(seed, "seed", 0, 2**64)
    autocast = device.type == "cuda" if autocast is None else bool(autocast)

    corpus_map = _tokenize_tasks(tasks, tokenizer, "tasks", add_special_tokens)
    names = list(corpus_map)
    corpus = [corpus_map[n] for n in names]
    if eval_tasks is None:
        eval_tokens = {n: [s[:seq_len] for s in corpus_map[n][:eval_examples]] for n in names}
    else:
        eval_tokens = _tokenize_tasks(eval_tasks, tokenizer, "eval_tasks", add_special_tokens)
    for n, seqs in list(corpus_map.items()) + list(eval_tokens.items()):
        if max(max(s) for s in seqs) >= vocab_size or min(min(s) for s in seqs) < 0:
            raise ValueError(f"tasks[{n!r}] has token ids outside [0, vocab_size={vocab_size})")
    num_tasks = len(names)

    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    rows_per_step = batch_size_per_task * num_tasks
    if rows_per_step < world:
        raise ValueError(f"batch_size_per_task * num_tasks = {rows_per_step} is smaller than the world size {world}: "
                         "every process needs at least one sequence")

    config = {"method": method, "weight_basis": weight_basis, "weight_floor": weight_floor, "tasks": names,
              "task_sizes": [len(c) for c in corpus], "batch_size_per_task": batch_size_per_task,
              "seq_len": seq_len, "lr": lr, "weight_decay": weight_decay, "max_grad_norm": max_grad_norm,
              "temperature": temperature, "seed": seed, "normalize_weights": normalize_weights,
              "tasks_digest": _tasks_digest(corpus, eval_tokens)}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    ckpt_path = os.path.join(os.fspath(checkpoint_dir), CHECKPOINT_NAME) if checkpoint_dir is not None else None
    checkpoint_every = checkpoint_every or eval_every
    history: list[dict[str, Any]] = []
    start_step = 0
    resumed_since_eval: list[float] = []
    verifier_was_training, drafter_was_training = verifier.training, drafter.training
    verifier.eval()

    def evaluate_now(step: int, train_loss: float | None) -> None:
        entry = {"step": step, **_evaluate(verifier, drafter, eval_tokens, weight_basis, temperature, vocab_size,
                                           batch_size_per_task, backend, autocast)}
        entry["train_loss"] = train_loss
        history.append(entry)

    if ckpt_path is not None and resume and os.path.exists(ckpt_path):
        ckpt = load_checkpoint(ckpt_path)  # CheckpointError on a bad file: nothing is overwritten
        saved = ckpt["meta"]["config"]
        different = sorted(k for k in config if saved.get(k) != config[k])
        if different:
            raise CheckpointError(f"checkpoint {ckpt_path} was written by a run with different settings "
                                  f"({', '.join(different)}); use another checkpoint_dir or resume=False")
        _restore(ckpt, drafter, optimizer, generator, ckpt_path)
        start_step = int(ckpt["meta"]["step"])
        history = list(ckpt["meta"]["history"])
        resumed_since_eval = [float(x) for x in ckpt["meta"].get("since_eval", [])]
    if not history:
        evaluate_now(0, None)

    model = drafter
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)

    def save(step: int) -> None:
        if ckpt_path is None:
            return
        if rank == 0:
            save_checkpoint(ckpt_path, drafter, optimizer, step, generator, history, config, since_eval)
        if distributed:
            dist.barrier()

    losses: list[float] = []
    since_eval: list[float] = resumed_since_eval
    drafter.train()
    bar = tqdm(total=steps, initial=min(start_step, steps), desc=f"finetune[{method}]",
               disable=not progress or rank != 0)
    try:
        for step in range(start_step + 1, steps + 1):
            rows = _draw_global_batch(method, corpus, batch_size_per_task, seq_len, generator)[rank::world]
            ids, mask = pad_batch([r[1] for r in rows], pad_token_id, "right", device)
            row_task = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                with torch.no_grad():
                    v_logits, _ = prefix_logits(verifier, ids, mask, vocab_size)
                d_logits, _ = prefix_logits(model, ids, mask, vocab_size)
            task_ids = row_task[prefix_rows(mask)]
            with torch.no_grad():
                div = divergence(v_logits, d_logits.detach(), temperature=temperature, backend=backend)
                stats = torch.zeros(4, num_tasks, dtype=torch.float64, device=device)
                for k, value in enumerate((div.cross_entropy, div.kl, div.tv)):
                    stats[k].index_add_(0, task_ids, value.double())
                stats[3].index_add_(0, task_ids, torch.ones_like(task_ids, dtype=torch.float64))
                if distributed:
                    dist.all_reduce(stats)
                counts = stats[3]
                values = stats[:3] / counts.clamp_min(1)
                basis = values[WEIGHT_BASES.index(weight_basis)]
                if method == "uniform_kd":
                    tok_w = torch.full_like(task_ids, 1.0, dtype=torch.float32) / counts.sum().float()
                    weights = counts.float() / counts.sum().float()
                else:
                    present = counts > 0
                    weights = torch.zeros(num_tasks, dtype=torch.float32, device=device)
                    weights[present] = scdf_weights(
                        basis[present], {"scdf": "scdf", "exact_variance": "exact_variance"}.get(method, "uniform"),
                        floor=weight_floor, normalize=normalize_weights).to(device)
                    tok_w = token_weights_unchecked(task_ids, weights, counts)
                objective = float((weights.double() * values[0]).sum()) if method != "uniform_kd" else float(
                    stats[0].sum() / counts.sum())
            loss = divergence_loss(d_logits, v_logits, weights=tok_w, temperature=temperature, reduction="sum",
                                   backend=backend)
            (loss * world).backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                drafter.parameters(), max_grad_norm if max_grad_norm is not None else float("inf")))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(objective)
            since_eval.append(objective)
            bar.update(1)
            if callback is not None:
                callback(step, {"loss": objective, "weights": weights.tolist(), "task_values": basis.tolist(),
                                "grad_norm": grad_norm})
            is_last = step == steps
            if is_last or (eval_every is not None and step % eval_every == 0):
                evaluate_now(step, sum(since_eval) / len(since_eval))
                since_eval = []
                bar.set_postfix(U=f"{history[-1]['U']:.4g}", worst_alpha=f"{history[-1]['worst_alpha']:.3f}")
            if is_last or (checkpoint_every is not None and step % checkpoint_every == 0):
                save(step)
    finally:
        bar.close()
        drafter.train(drafter_was_training)
        verifier.train(verifier_was_training)
    return FinetuneResult(drafter=drafter, history=history, losses=losses, steps=max(start_step, steps),
                          method=method, weight_basis=weight_basis, resumed_from=start_step,
                          checkpoint_path=ckpt_path)

