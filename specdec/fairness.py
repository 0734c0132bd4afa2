"""Per-task disparity of speculative decoding: measurement, bounds and report (DESIGN.md, "The mathematics").

For each task T (a set of reference texts and/or prompts) :func:`evaluate` measures, with p the verifier and q the
drafter after the same temperature, averaged over all prefixes s of the task's texts (teacher forcing):

* ``alpha_T = E alpha(s)``, ``alpha(s) = sum_x min(p, q) = 1 - TV(p, q)``; ``speedup = S(alpha_T)`` with
  ``S(a) = (1 - a^(K+1)) / ((1 - a)(K c + 1))``;
* ``K_T = E H(p, q)`` (cross-entropy), ``D_T = E KL(p || q)``, ``TV_T = E TV(p, q)``, ``H_T(p) = K_T - D_T``;
* with the text as reference (``pi_T`` one-hot on the observed next token y): ``r_q = 1 - E q(y|s)``,
  ``r_p = 1 - E p(y|s)``, drafter fitness ``1 - r_q``;
* from real :func:`specdec.generate` runs on the prompts: the measured acceptance rate and tokens per verifier call.

Across tasks: ``U = (1/m) sum_i (K_i - Kbar)^2`` on K_T (and on D_T, TV_T), spreads of alpha_T and S_T, the Spearman
correlation of fitness with speed-up, and per-character figures when a tokenizer is given. The DESIGN bounds
``E_s S(alpha(s)) >= S(1 - TV_T) >= S(max(0, 1 - sqrt(D_T / 2)))`` and the triangle bounds
``1 - r_q - r_p <= alpha_T <= 1 - r_q + r_p`` are checked; violations are recorded, never raised.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specdec._models import check_model_pair, model_device, model_vocab_size
from specdec.metrics import expected_tokens_per_call, speedup, speedup_lower_bounds

_BOUND_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------- inputs
@dataclass
class TaskData:
    """One task: ``prompts`` for real speculative-decoding runs, ``texts`` for teacher-forced divergences.

    Each is a list of strings (needs a tokenizer) or of token-id lists, or None. A plain sequence given as a task to
    :func:`evaluate` is taken as ``texts``; a mapping may have the keys ``"prompts"`` and ``"texts"``.
    """

    prompts: list[str] | list[list[int]] | None = None
    texts: list[str] | list[list[int]] | None = None


def _as_task_data(name: str, value: object) -> TaskData:
    if isinstance(value, TaskData):
        data = value
    elif isinstance(value, Mapping):
        unknown = set(value) - {"prompts", "texts"}
        if unknown:
            raise ValueError(f"tasks[{name!r}] may only have the keys 'prompts' and 'texts', got {sorted(unknown)}")
        data = TaskData(prompts=value.get("prompts"), texts=value.get("texts"))
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        data = TaskData(texts=list(value))
    else:
        raise TypeError(f"tasks[{name!r}] must be a TaskData, a mapping with 'prompts'/'texts' or a sequence of texts, "
                        f"got {type(value).__name__}")
    for field_name in ("prompts", "texts"):
        items = getattr(data, field_name)
        if items is None:
            continue
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"tasks[{name!r}].{field_name} must be a list of strings or token-id lists, "
                            f"got {type(items).__name__}")
        if len(items) == 0:
            raise ValueError(f"tasks[{name!r}].{field_name} is empty")
    if data.prompts is None and data.texts is None:
        raise ValueError(f"tasks[{name!r}] has neither prompts nor texts")
    return data


def _text_length(tokenizer: Any, ids: list[int]) -> int:
    """Characters of the text ``ids`` decode to, special tokens (bos, eos, pad) left out; a tokenizer whose
    ``decode`` has no ``skip_special_tokens`` is trusted to leave them out itself."""
    try:
        return len(tokenizer.decode(ids, skip_special_tokens=True))
    except TypeError:
        return len(tokenizer.decode(ids))


def encode_items(items: Sequence[str] | Sequence[Sequence[int]], tokenizer: Any, name: str,
                 add_special_tokens: bool = False,
                 vocab: int | None = None) -> tuple[list[list[int]], list[int | None]]:
    """Token ids and character counts of a list of texts or token-id lists.

    Strings are encoded with ``tokenizer.encode(text, add_special_tokens=...)``; token-id lists pass through (their
    character count comes from ``tokenizer.decode(..., skip_special_tokens=True)`` when a tokenizer is given, else
    None).
    Returns ``(token_lists, char_counts)``. With ``vocab``, ids outside ``[0, vocab)`` raise ValueError.
    """
    token_lists: list[list[int]] = []
    chars: list[int | None] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"{name}[{index}] is a string: pass tokenizer= to encode text "
                                 "(or give token-id lists)")
            ids = list(tokenizer.encode(item, add_special_tokens=add_special_tokens))
            chars.append(len(item))
        elif isinstance(item, (Sequence, torch.Tensor)) and not isinstance(item, bytes):
            ids = item.tolist() if isinstance(item, torch.Tensor) else list(item)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"{name}[{index}] must be a string or a list of int token ids")
            chars.append(_text_length(tokenizer, ids) if tokenizer is not None else None)
        else:
            raise TypeError(f"{name}[{index}] must be a string or a list of int token ids, got {type(item).__name__}")
        if vocab is not None and ids and not 0 <= min(ids) <= max(ids) < vocab:
            raise ValueError(f"{name}[{index}] has token ids outside [0, {vocab}) (the models' shared vocabulary): "
                             f"min {min(ids)}, max {max(ids)}")
        token_lists.append(ids)
    return token_lists, chars


def pad_batch(sequences: Sequence[Sequence[int]], pad_token_id: int = 0, side: str = "right",
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists into ``input_ids`` [B, L] int64 and ``attention_mask`` [B, L] int64 (1 = real token)."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), length), dtype=torch.int64)
    for row, seq in enumerate(sequences):
        if not seq:
            continue
        sl = slice(length - len(seq), length) if side == "left" else slice(0, len(seq))
        ids[row, sl] = torch.as_tensor(list(seq), dtype=torch.int64)
        mask[row, sl] = 1
    return ids.to(device), mask.to(device)


# ----------------------------------------------------------------------------------------- per-token divergences
def prefix_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits at every prefix with an observed next token.

    Args:
        input_ids, attention_mask: [B, L] right-padded batch.
        vocab_size: keep only the first ``vocab_size`` logits (shared vocabulary).
    Returns:
        ``(logits [N, V], targets [N] int64)`` where row n is position t of row b with ``mask[b, t] = mask[b, t+1] =
        1`` (row-major order) and ``targets`` the observed token ``input_ids[b, t+1]``. Logits keep the model's dtype.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out.logits[:, :-1]
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    valid = (attention_mask[:, :-1] > 0) & (attention_mask[:, 1:] > 0)
    return logits[valid], input_ids[:, 1:][valid]


def prefix_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N] int64 batch row of every prefix selected by :func:`prefix_logits` (same order)."""
    valid = (attention_mask[:, :-1] > 0) & (attention_mask[:, 1:] > 0)
    rows = torch.arange(attention_mask.shape[0], device=attention_mask.device)[:, None].expand_as(valid)
    return rows[valid]


@dataclass
class TokenDivergences:
    """Per-prefix divergences, all [N] float32 on the CPU (one entry per prefix with an observed next token).

    cross_entropy: H(p, q) = -sum p log q. kl: KL(p || q). tv: TV(p, q). alpha: sum min(p, q) (at temperature 0:
    1[argmax p == argmax q], the greedy acceptance). entropy: H(p) = cross_entropy - kl. ref_q, ref_p: q(y|s), p(y|s)
    of the observed next token y (at temperature 0: 1[argmax == y]).
    """

    cross_entropy: torch.Tensor
    kl: torch.Tensor
    tv: torch.Tensor
    alpha: torch.Tensor
    entropy: torch.Tensor
    ref_q: torch.Tensor
    ref_p: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[TokenDivergences]) -> TokenDivergences:
        names = [f.name for f in TokenDivergences.__dataclass_fields__.values()]
        return TokenDivergences(**{n: torch.cat([getattr(p, n) for p in parts]) for n in names})

    @property
    def num_tokens(self) -> int:
        return int(self.alpha.numel())

    def means(self) -> dict[str, float]:
        """Means over prefixes: K_T, D_T, TV_T, alpha_T, H_T(p), r_q = 1 - E q(y), r_p = 1 - E p(y)."""
        def mean(t: torch.Tensor) -> float:
            return float(t.double().mean()) if t.numel() else float("nan")

        return {"cross_entropy": mean(self.cross_entropy), "kl": mean(self.kl), "tv": mean(self.tv),
                "alpha": mean(self.alpha), "entropy": mean(self.entropy), "r_q": 1.0 - mean(self.ref_q),
                "r_p": 1.0 - mean(self.ref_p)}


def divergences_from_logits(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, targets: torch.Tensor,
                            temperature: float = 1.0, backend: str = "auto") -> TokenDivergences:
    """:class:`TokenDivergences` from [N, V] logits and [N] observed next tokens, through
    :func:`specdec.divergences.divergence` (fused kernel on CUDA). Temperature 0 (greedy) computes CE/KL/TV at
    temperature 1 and the greedy acceptance ``1[argmax p == argmax q]``."""
    from specdec.divergences import divergence

    div_temp = temperature if temperature > 0 else 1.0
    div = divergence(verifier_logits, drafter_logits, temperature=div_temp, backend=backend)
    if temperature > 0:
        alpha = div.alpha.float()
        ref_q = torch.softmax(drafter_logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
        ref_p = torch.softmax(verifier_logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
    else:
        arg_p, arg_q = verifier_logits.argmax(-1), drafter_logits.argmax(-1)
        alpha = (arg_p == arg_q).float()
        ref_q, ref_p = (arg_q == targets).float(), (arg_p == targets).float()
    cross_entropy, kl = div.cross_entropy.float(), div.kl.float()
    entropy = cross_entropy - kl  # H(p) = H(p, q) - KL(p || q), both from the one fused pass
    undefined = ~torch.isfinite(entropy)  # q = 0 where p > 0: H(p, q) = KL = +inf, while H(p) is finite
    if bool(undefined.any()):
        p = torch.softmax(verifier_logits[undefined].float() / div_temp, -1)
        entropy[undefined] = torch.special.entr(p).sum(-1)
    return TokenDivergences(cross_entropy=cross_entropy.cpu(), kl=kl.cpu(), tv=div.tv.float().cpu(),
                            alpha=alpha.cpu(), entropy=entropy.cpu(), ref_q=ref_q.float().cpu(),
                            ref_p=ref_p.float().cpu())


@torch.no_grad()
def token_divergences(verifier: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, temperature: float = 1.0, backend: str = "auto",
                      vocab_size: int | None = None) -> TokenDivergences:
    """Teacher-forced per-prefix divergences of one right-padded batch ``input_ids`` [B, L] (int64).

    Both models run once on the batch (no grad; their train/eval mode is left as it is). ``vocab_size`` restricts
    the logits to a shared id range (default: the smaller of the two output sizes).
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if vocab_size is None:
        vocab_size = min(model_vocab_size(verifier), model_vocab_size(drafter))
    v_logits, targets = prefix_logits(verifier, input_ids, attention_mask, vocab_size)
    d_logits, _ = prefix_logits(drafter, input_ids, attention_mask, vocab_size)
    return divergences_from_logits(v_logits, d_logits, targets, temperature=temperature, backend=backend)


def task_divergences(verifier: torch.nn.Module, drafter: torch.nn.Module,
                     task_tokens: Mapping[str, Sequence[Sequence[int]]], *, batch_size: int = 8,
                     temperature: float = 1.0, backend: str = "auto", max_length: int | None = None,
                     pad_token_id: int = 0, vocab_size: int | None = None) -> dict[str, TokenDivergences]:
    """Per-task :class:`TokenDivergences` over every prefix of every token list of each task.

    Args:
        task_tokens: task name -> list of token-id lists (each truncated to its first ``max_length`` tokens).
        batch_size: sequences per forward pass.
    Returns:
        task name -> per-prefix divergences (CPU float32 tensors); use ``.means()`` for K_T, D_T, TV_T, alpha_T, ...
    """
    device = model_device(verifier)
    result: dict[str, TokenDivergences] = {}
    for name, seqs in task_tokens.items():
        seqs = [list(s)[:max_length] if max_length else list(s) for s in seqs]
        seqs = [s for s in seqs if len(s) >= 2]
        if not seqs:
            raise ValueError(f"task {name!r} has no text of at least 2 tokens (nothing to teacher-force)")
        parts = []
        for start in range(0, len(seqs), batch_size):
            ids, mask = pad_batch(seqs[start:start + batch_size], pad_token_id, "right", device)
            parts.append(token_divergences(verifier, drafter, ids, mask, temperature=temperature, backend=backend,
                                           vocab_size=vocab_size))
        result[name] = TokenDivergences.cat(parts)
    return result


# ------------------------------------------------------------------------------------------------- aggregates
def unfairness(values: Sequence[float] | torch.Tensor | Mapping[str, float]) -> float:
    """U = (1/m) sum_i (v_i - vbar)^2: population variance of per-task values (uniform task weights).

    ``values``: one number per task (a 1-D sequence or tensor, or a mapping task -> value). NaN raises ValueError; an
    infinite value (e.g. an infinite cross-entropy) gives ``inf``."""
    if isinstance(values, Mapping):
        values = list(values.values())
    if isinstance(values, torch.Tensor):
        if values.dim() > 1:
            raise ValueError(f"values must be 1-D (one value per task), got shape {tuple(values.shape)}")
        values = values.detach().double().flatten().tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"values must be a sequence of per-task numbers, got {type(values).__name__}")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"values must hold numbers (one per task): {exc}") from None
    if not values:
        raise ValueError("values must contain at least one per-task value")
    if any(math.isnan(v) for v in values):
        raise ValueError(f"values must not contain NaN, got {values}")
    if any(math.isinf(v) for v in values):
        return math.inf  # e.g. a task with infinite cross-entropy (p > 0 where q = 0): unbounded dispersion
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 2 points or a constant input."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _spread(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {}
    low, high = min(values), max(values)
    return {f"{prefix}_mean": sum(values) / len(values), f"{prefix}_min": low, f"{prefix}_max": high,
            f"{prefix}_max_over_min": high / low if low > 0 else None,
            f"{prefix}_std": statistics.pstdev(values) if len(values) > 1 else 0.0}


@torch.no_grad()
def measure_cost_ratio(verifier: torch.nn.Module, drafter: torch.nn.Module, *, batch_size: int = 1,
                       seq_len: int = 16, repeats: int = 5, warmup: int = 2, seed: int = 0) -> float:
    """c = t_drafter / t_verifier: median wall time of one forward pass of each model on the same random
    [batch_size, seq_len] batch, on the models' device (CUDA synchronised)."""
    device = model_device(verifier)
    vocab = min(model_vocab_size(verifier), model_vocab_size(drafter))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device)

    def timed(model: torch.nn.Module) -> float:
        times = []
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(input_ids=ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timed(drafter) / max(timed(verifier), 1e-12)


def _generation_figures(verifier: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]], *,
                        tokenizer: Any, num_draft_tokens: int, temperature: float, max_new_tokens: int,
                        batch_size: int, seed: int, backend: str, eos_token_id: int | Sequence[int] | None,
                        pad_token_id: int, vocab_size: int | None) -> dict[str, float | int | None]:
    from specdec._seeding import derive_seed
    from specdec.generate import generate

    device = model_device(verifier)
    drafted = accepted = generated = calls = tested = accepted_tested = 0
    chars = 0
    for batch_index, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start:start + batch_size]
        ids, mask = pad_batch(chunk, pad_token_id, "left", device)
        out = generate(verifier, drafter, ids, mask, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                       temperature=temperature, eos_token_id=eos_token_id, seed=derive_seed(seed, batch_index),
                       backend=backend, pad_token_id=pad_token_id, vocab_size=vocab_size)
        stats = out.stats
        drafted += int(stats.drafted.sum())
        accepted += int(stats.accepted.sum())
        generated += int(stats.generated.sum())
        calls += int(stats.verifier_calls.sum())
        tested += int(stats.attempted_per_position.sum())
        accepted_tested += int(stats.accepted_per_position.sum())
        if tokenizer is not None:
            width = ids.shape[1]
            for row in range(len(chunk)):
                new = out.sequences[row, width:width + int(stats.generated[row])].tolist()
                chars += _text_length(tokenizer, new)  # an emitted eos is no text
    tokens_per_call = generated / calls if calls else float("nan")
    return {
        "num_prompts": len(prompts), "generated_tokens": generated,
        "alpha_measured": accepted_tested / tested if tested else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_call": tokens_per_call,
        "chars_per_call": chars / calls if (tokenizer is not None and calls) else None,
        "gen_chars_per_token": chars / generated if (tokenizer is not None and generated) else None,
    }


# ---------------------------------------------------------------------------------------------------- report
@dataclass
class TaskFairness:
    """One task's row of the report. None where the input needed for a figure was not given.

    Teacher-forced (texts): alpha (alpha_T), speedup (S(alpha_T)), speedup_prefix_mean (E_s S(alpha(s))),
    cross_entropy (K_T), kl (D_T), tv (TV_T), entropy (H_T(p)), r_q, r_p, fitness (1 - r_q), bound_tv
    (S(1 - TV_T)), bound_pinsker (S(max(0, 1 - sqrt(D_T/2)))), chars_per_token, char_speedup. At temperature 0
    the divergences are taken at T = 1 and bound no greedy speed-up: bound_tv and bound_pinsker stay None.
    Generation (prompts): alpha_measured (accepted / tested drafts: a draft after a rejection is never tested, so
    this estimates alpha), acceptance_rate (accepted / drafted, the raw counter ratio), tokens_per_call (measured),
    tokens_per_call_predicted (E[N] from alpha_T), speedup_measured (tokens_per_call / (K c + 1)), chars_per_call,
    char_speedup_measured.
    """

    name: str
    num_texts: int = 0
    num_tokens: int = 0
    alpha: float | None = None
    speedup: float | None = None
    speedup_prefix_mean: float | None = None
    cross_entropy: float | None = None
    kl: float | None = None
    tv: float | None = None
    entropy: float | None = None
    r_q: float | None = None
    r_p: float | None = None
    fitness: float | None = None
    bound_tv: float | None = None
    bound_pinsker: float | None = None
    chars_per_token: float | None = None
    char_speedup: float | None = None
    num_prompts: int = 0
    alpha_measured: float | None = None
    acceptance_rate: float | None = None
    tokens_per_call: float | None = None
    tokens_per_call_predicted: float | None = None
    speedup_measured: float | None = None
    chars_per_call: float | None = None
    char_speedup_measured: float | None = None


@dataclass
class FairnessReport:
    """Result of :func:`evaluate`: ``tasks`` (one :class:`TaskFairness` per task), ``summary`` (cross-task figures,
    settings and ``bound_violations``)."""

    tasks: list[TaskFairness]
    summary: dict[str, Any] = field(default_factory=dict)

    def task(self, name: str) -> TaskFairness:
        for row in self.tasks:
            if row.name == name:
                return row
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict: ``{"tasks": [row dicts], "summary": {...}}``."""
        return {"tasks": [asdict(row) for row in self.tasks], "summary": dict(self.summary)}

    def to_markdown(self) -> str:
        """Per-task table, then the cross-task summary and any bound violations."""
        def fmt(value: object) -> str:
            if value is None:
                return "–"
            if isinstance(value, float):
                return "nan" if math.isnan(value) else f"{value:.4g}"
            return str(value)

        columns = [("task", "name"), ("α_T", "alpha"), ("S_T", "speedup"), ("K_T (CE)", "cross_entropy"),
                   ("D_T (KL)", "kl"), ("TV_T", "tv"), ("H_T(p)", "entropy"), ("r_q", "r_q"), ("r_p", "r_p"),
                   ("S(1−TV)", "bound_tv"), ("S Pinsker", "bound_pinsker"), ("α gen", "alpha_measured"),
                   ("tok/call", "tokens_per_call"), ("chars/call", "chars_per_call"),
                   ("char S_T", "char_speedup")]
        columns = [c for c in columns if c[1] == "name" or any(getattr(r, c[1]) is not None for r in self.tasks)]
        lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
        for row in self.tasks:
            lines.append("| " + " | ".join(fmt(getattr(row, c[1])) for c in columns) + " |")
        s = self.summary
        lines += ["", f"K = {s.get('num_draft_tokens')}, cost ratio c = {fmt(s.get('cost_ratio'))} "
                  f"({'measured' if s.get('cost_ratio_measured') else 'given'}), temperature = {s.get('temperature')}",
                  ""]
        keys = ["U_ce", "U_kl", "U_tv", "alpha_mean", "alpha_min", "alpha_max", "alpha_max_over_min", "alpha_std",
                "speedup_mean", "speedup_min", "speedup_max", "speedup_max_over_min", "speedup_std", "worst_task",
                "spearman_fitness_speedup", "alpha_measured_mean", "alpha_measured_min", "char_speedup_max_over_min",
                "chars_per_call_max_over_min"]
        lines += [f"- {k}: {fmt(s[k])}" for k in keys if k in s]
        violations = s.get("bound_violations", [])
        if violations:
            lines.append(f"- bounds checked: {len(violations)} violated")
        elif s.get("bounds_checked", False):
            lines.append("- bounds checked: all hold")
        else:
            lines.append("- bounds checked: not checked (greedy decoding, or no task with texts)")
        lines += [f"  - {v}" for v in violations]
        return "\n".join(lines) + "\n"

    def plot(self, path: str) -> str:
        """PNG with per-task bars of alpha, speed-up (with its bounds) and K_T = H_T(p) + D_T, and a scatter of
        drafter fitness (1 - r_q) against speed-up. Returns ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r.name for r in self.tasks]
        x = list(range(len(names)))

        def vals(attr: str) -> list[float]:
            return [float("nan") if getattr(r, attr) is None else float(getattr(r, attr)) for r in self.tasks]

        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        ax = axes[0, 0]
        ax.bar([i - 0.2 for i in x], vals("alpha"), 0.4, label="α_T (teacher-forced)")
        ax.bar([i + 0.2 for i in x], vals("alpha_measured"), 0.4, label="α (generation)")
        ax.set_title("acceptance α per task")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax = axes[0, 1]
        for offset, attr, label in ((-0.3, "speedup", "S(α_T)"), (-0.1, "bound_tv", "S(1−TV_T)"),
                                    (0.1, "bound_pinsker", "S(1−√(D_T/2))"), (0.3, "speedup_measured", "measured")):
            ax.bar([i + offset for i in x], vals(attr), 0.2, label=label)
        ax.set_title("speed-up per task")
        ax.legend(fontsize=8)
        ax = axes[1, 0]
        entropy, kl = vals("entropy"), vals("kl")
        ax.bar(x, entropy, 0.6, label="H_T(p)")
        ax.bar(x, kl, 0.6, bottom=entropy, label="D_T (KL)")
        ax.set_title("K_T = H_T(p) + D_T (nats)")
        ax.legend(fontsize=8)
        for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax = axes[1, 1]
        fit, spd = vals("fitness"), vals("speedup")
        ax.scatter(fit, spd)
        for name, fx, sy in zip(names, fit, spd, strict=True):
            ax.annotate(name, (fx, sy), fontsize=8)
        rho = self.summary.get("spearman_fitness_speedup")
        ax.set_title(f"drafter fitness vs speed-up (Spearman {rho:.2f})" if rho is not None
                     else "drafter fitness vs speed-up")
        ax.set_xlabel("fitness 1 − r_q")
        ax.set_ylabel("S_T")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)
        return path


def _check_bounds(row: TaskFairness, temperature: float) -> list[str]:
    violations = []
    if row.alpha is None or temperature == 0:
        return violations
    if row.speedup_prefix_mean < row.bound_tv - _BOUND_TOL * max(1.0, row.bound_tv):
        violations.append(f"{row.name}: E_s S(alpha(s)) = {row.speedup_prefix_mean:.6g} < S(1 - TV_T) = "
                          f"{row.bound_tv:.6g}")
    if row.bound_tv < row.bound_pinsker - _BOUND_TOL * max(1.0, row.bound_pinsker):
        violations.append(f"{row.name}: S(1 - TV_T) = {row.bound_tv:.6g} < S(1 - sqrt(D_T/2)) = "
                          f"{row.bound_pinsker:.6g} (Pinsker)")
    if row.speedup < row.bound_tv - _BOUND_TOL * max(1.0, row.bound_tv):
        violations.append(f"{row.name}: S(alpha_T) = {row.speedup:.6g} < S(1 - TV_T) = {row.bound_tv:.6g}")
    low, high = 1.0 - row.r_q - row.r_p, 1.0 - row.r_q + row.r_p
    if not (low - _BOUND_TOL <= row.alpha <= high + _BOUND_TOL):
        violations.append(f"{row.name}: alpha_T = {row.alpha:.6g} outside the fitness bounds "
                          f"[1 - r_q - r_p, 1 - r_q + r_p] = [{low:.6g}, {high:.6g}]")
    return violations


def _check_positive_int(value: object, name: str, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None' if allow_none else ''}, got {value!r}")


def evaluate(verifier: torch.nn.Module, drafter: torch.nn.Module,
             tasks: Mapping[str, TaskData | Mapping[str, Any] | Sequence[Any]], *, tokenizer: Any = None,
             num_draft_tokens: int = 4, temperature: float = 1.0, max_new_tokens: int = 32, batch_size: int = 8,
             max_examples: int | None = None, cost_ratio: float | None = None, seed: int = 0, progress: bool = True,
             backend: str = "auto", max_length: int | None = 512, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, vocab_size: int | None = None,
             add_special_tokens: bool = False) -> FairnessReport:
    """Measure how unequally a drafter-verifier pair accelerates each task.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device sharing a vocabulary (neither is modified; both run
            under no_grad).
        tasks: name -> :class:`TaskData`, a mapping with ``"prompts"``/``"texts"``, or a sequence of texts.
        tokenizer: HF-style object with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``; needed for
            string inputs and for the per-character figures.
        num_draft_tokens: K drafts per round (>= 1). temperature: >= 0, 0 is greedy (see
            :func:`divergences_from_logits`).
        max_new_tokens: tokens generated per prompt. batch_size: sequences per forward / generate call.
        max_examples: use at most this many prompts and texts per task. max_length: truncate texts to this many tokens.
        cost_ratio: c = t_drafter / t_verifier; None measures it with :func:`measure_cost_ratio`.
        seed: seeds the generation runs. backend: divergence and rejection-sampling backend.
        eos_token_id, pad_token_id: for generation (pad default: tokenizer.pad_token_id, else eos, else 0).
        vocab_size: shared id range when the models' output sizes differ.

    Returns:
        :class:`FairnessReport`.
    """
    from specdec._validation import check_backend, check_int_range, check_temperature

    check_model_pair(verifier, drafter)
    if not isinstance(tasks, Mapping):
        raise TypeError(f"tasks must be a mapping from task name to TaskData, got {type(tasks).__name__}")
    if len(tasks) == 0:
        raise ValueError("tasks must contain at least one task")
    _check_positive_int(num_draft_tokens, "num_draft_tokens")
    _check_positive_int(max_new_tokens, "max_new_tokens")
    _check_positive_int(batch_size, "batch_size")
    _check_positive_int(max_examples, "max_examples", allow_none=True)
    _check_positive_int(max_length, "max_length", allow_none=True)
    temperature = check_temperature(temperature)
    check_backend(backend)
    if cost_ratio is not None and (isinstance(cost_ratio, bool) or not isinstance(cost_ratio, (int, float))
                                   or not math.isfinite(cost_ratio) or cost_ratio < 0):
        raise ValueError(f"cost_ratio must be a finite number >= 0 or None, got {cost_ratio!r}")
    if tokenizer is not None and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError("tokenizer must have encode(text, add_special_tokens=False) and decode(ids) methods")
    data = {str(name): _as_task_data(str(name), value) for name, value in tasks.items()}
    id_limit = min(model_vocab_size(verifier, "verifier"), model_vocab_size(drafter, "drafter"))
    if vocab_size is not None:
        id_limit = check_int_range(vocab_size, "vocab_size", 1, id_limit + 1, note=" (the models' output sizes)")
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            eos = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else None)
            pad_token_id = eos if eos is not None else 0
    check_int_range(pad_token_id, "pad_token_id", 0, id_limit)

    measured = cost_ratio is None
    if measured:
        cost_ratio = measure_cost_ratio(verifier, drafter, batch_size=batch_size, seed=seed)
    c = float(cost_ratio)
    K = num_draft_tokens

    from tqdm.auto import tqdm

    rows: list[TaskFairness] = []
    for name, task in tqdm(data.items(), desc="fairness", disable=not progress):
        row = TaskFairness(name=name)
        if task.texts is not None:
            texts = list(task.texts)[:max_examples]
            tokens, chars = encode_items(texts, tokenizer, f"tasks[{name!r}].texts", add_special_tokens, id_limit)
            div = task_divergences(verifier, drafter, {name: tokens}, batch_size=batch_size, temperature=temperature,
                                   backend=backend, max_length=max_length, pad_token_id=pad_token_id,
                                   vocab_size=vocab_size)[name]
            m = div.means()
            row.num_texts, row.num_tokens = len(texts), div.num_tokens
            row.alpha, row.cross_entropy, row.kl, row.tv, row.entropy = (m["alpha"], m["cross_entropy"], m["kl"],
                                                                        m["tv"], m["entropy"])
            row.r_q, row.r_p, row.fitness = m["r_q"], m["r_p"], 1.0 - m["r_q"]
            alpha_clamped = min(max(row.alpha, 0.0), 1.0)
            row.speedup = float(speedup(alpha_clamped, K, c))
            row.speedup_prefix_mean = float(speedup(div.alpha.double().clamp(0, 1), K, c).mean())
            if temperature > 0:  # TV_T and D_T are taken at T = 1 when greedy: they bound no greedy S_T
                row.bound_tv, row.bound_pinsker = speedup_lower_bounds(min(max(row.tv, 0.0), 1.0),
                                                                       max(row.kl, 0.0), K, c)
            row.tokens_per_call_predicted = float(expected_tokens_per_call(alpha_clamped, K))
            if all(ch is not None for ch in chars):
                kept = [min(len(t), max_length) if max_length else len(t) for t in tokens]
                total_tokens = sum(kept)
                # characters of the truncated texts, approximated pro rata when truncation cut a text
                total_chars = sum(ch * k / max(len(t), 1) for ch, k, t in zip(chars, kept, tokens, strict=True))
                row.chars_per_token = total_chars / total_tokens if total_tokens else None
        if task.prompts is not None:
            prompts = list(task.prompts)[:max_examples]
            prompt_tokens, _ = encode_items(prompts, tokenizer, f"tasks[{name!r}].prompts", add_special_tokens)
            if any(len(p) == 0 for p in prompt_tokens):
                raise ValueError(f"tasks[{name!r}].prompts contains an empty prompt")
            gen = _generation_figures(verifier, drafter, prompt_tokens, tokenizer=tokenizer, num_draft_tokens=K,
                                      temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                      seed=seed, backend=backend, eos_token_id=eos_token_id,
                                      pad_token_id=pad_token_id, vocab_size=vocab_size)
            row.num_prompts = gen["num_prompts"]
            row.alpha_measured, row.tokens_per_call = gen["alpha_measured"], gen["tokens_per_call"]
            row.acceptance_rate = gen["acceptance_rate"]
            row.speedup_measured = row.tokens_per_call / (K * c + 1.0)
            row.chars_per_call = gen["chars_per_call"]
            if row.chars_per_token is None and gen["gen_chars_per_token"] is not None:
                row.chars_per_token = gen["gen_chars_per_token"]
        rows.append(row)

    summary: dict[str, Any] = {"num_tasks": len(rows), "num_draft_tokens": K, "cost_ratio": c,
                               "cost_ratio_measured": measured, "temperature": temperature}
    scored = [r for r in rows if r.alpha is not None]
    if scored:
        summary["U_ce"] = unfairness([r.cross_entropy for r in scored])
        summary["U_kl"] = unfairness([r.kl for r in scored])
        summary["U_tv"] = unfairness([r.tv for r in scored])
        summary.update(_spread([r.alpha for r in scored], "alpha"))
        summary.update(_spread([r.speedup for r in scored], "speedup"))
        summary["worst_task"] = min(scored, key=lambda r: r.alpha).name
        summary["spearman_fitness_speedup"] = spearman([r.fitness for r in scored], [r.speedup for r in scored])
    generated = [r for r in rows if r.alpha_measured is not None]
    if generated:
        summary.update(_spread([r.alpha_measured for r in generated], "alpha_measured"))
        summary.update(_spread([r.tokens_per_call for r in generated], "tokens_per_call"))
    # Per-character figures: char_speedup = S_T * rho_T / mean(rho), rho_T = characters per token, i.e. the speed-up
    # in characters per unit of verifier time relative to plain decoding at the average characters per token.
    rho = [r.chars_per_token for r in rows if r.chars_per_token is not None]
    if rho and len(rho) == len(rows):
        rho_mean = sum(rho) / len(rho)
        for r in rows:
            if r.speedup is not None:
                r.char_speedup = r.speedup * r.chars_per_token / rho_mean
            if r.speedup_measured is not None:
                r.char_speedup_measured = r.speedup_measured * r.chars_per_token / rho_mean
        summary["chars_per_token_mean"] = rho_mean
        char_s = [r.char_speedup for r in rows if r.char_speedup is not None]
        if char_s:
            summary.update(_spread(char_s, "char_speedup"))
        cpc = [r.chars_per_call for r in rows if r.chars_per_call is not None]
        if cpc:
            summary.update(_spread(cpc, "chars_per_call"))
    violations: list[str] = []
    for r in rows:
        violations += _check_bounds(r, temperature)
    summary["bounds_checked"] = bool(scored) and temperature > 0
    summary["bound_violations"] = violations
    return FairnessReport(tasks=rows, summary=summary)
