"""Teacher-forced per-prefix divergences between a verifier and a drafter (the measurements behind the fairness report).

Texts (or token-id lists) are padded into batches, both models run once per batch, and at every prefix s with an
observed next token y the verifier's p(.|s) and the drafter's q(.|s) give H(p, q), KL(p || q), TV(p, q), the acceptance
alpha(s) = sum_x min(p, q), H(p), and q(y|s), p(y|s) (:class:`TokenDivergences`). :mod:`specdec.fairness` averages
them per task; :mod:`specdec.training.finetune` trains on the same prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec._models import model_device, model_vocab_size, pair_in_eval_mode
from specdec.decoding import ngram
from specdec.fairness.divergences import divergence


def decoded_length(tokenizer: Any, ids: list[int]) -> int:
    """Characters of the text ``ids`` decode to, special tokens (bos, eos, pad) left out; a tokenizer whose
    ``decode`` has no ``skip_special_tokens`` is trusted to leave them out itself."""
    try:
        return len(tokenizer.decode(ids, skip_special_tokens=True))
    except TypeError:
        return len(tokenizer.decode(ids))


def encode_items(items: Sequence[str] | Sequence[Sequence[int]], tokenizer: Any, name: str,
                 add_special_tokens: bool = False,
                 vocab: int | None = None, *,
                 count_chars: bool = True) -> tuple[list[list[int]], list[int | None]]:
    """Token ids and character counts of a list of texts or token-id lists.

    Strings are encoded with ``tokenizer.encode(text, add_special_tokens=...)``; token-id lists pass through (their
    character count comes from ``tokenizer.decode(..., skip_special_tokens=True)`` when a tokenizer is given, else
    None). ``count_chars=False`` counts nothing (every count None; no ``decode`` call).
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
            chars.append(len(item) if count_chars else None)
        elif isinstance(item, (Sequence, torch.Tensor)) and not isinstance(item, bytes):
            ids = item.tolist() if isinstance(item, torch.Tensor) else list(item)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"{name}[{index}] must be a string or a list of int token ids")
            chars.append(decoded_length(tokenizer, ids) if tokenizer is not None and count_chars else None)
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
    :func:`specdec.fairness.divergences.divergence` (fused kernel on CUDA). Temperature 0 (greedy) computes CE/KL/TV at
    temperature 1 and the greedy acceptance ``1[argmax p == argmax q]``."""

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


@pair_in_eval_mode
@torch.no_grad()
def token_divergences(verifier: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, temperature: float = 1.0, backend: str = "auto",
                      vocab_size: int | None = None) -> TokenDivergences:
    """Teacher-forced per-prefix divergences of one right-padded batch ``input_ids`` [B, L] (int64).

    Both models run once on the batch, under no_grad and in eval mode (every submodule's mode restored after).
    ``vocab_size`` restricts the logits to a shared id range (default: the smaller of the two output sizes).
An n-gram drafter
    (:func:`specdec.ngram_drafter`) gives one-hot logits at its proposal after each prefix, so ``alpha(s)`` is the
    verifier's ``p(draft)`` (greedy: ``1[draft == argmax p]``), ``TV = 1 - alpha`` and ``q(y) = 1[draft == y]``,
    while H(p, q) and KL(p || q) are infinite wherever ``p`` is not one-hot at the draft.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    ngram_drafter = ngram.as_ngram_drafter(drafter)
    if vocab_size is None:
        vocab_size = min(model_vocab_size(verifier), model_vocab_size(ngram.drafter_model(verifier, drafter)))
    v_logits, targets = prefix_logits(verifier, input_ids, attention_mask, vocab_size)
    if ngram_drafter is None:
        d_logits, _ = prefix_logits(drafter, input_ids, attention_mask, vocab_size)
    else:
        d_logits = ngram.prefix_logits(ngram_drafter, input_ids, attention_mask, v_logits.shape[-1], v_logits.dtype)
    return divergences_from_logits(v_logits, d_logits, targets, temperature=temperature, backend=backend)


@pair_in_eval_mode
def task_divergences(verifier: torch.nn.Module, drafter: torch.nn.Module,
                     task_tokens: Mapping[str, Sequence[Sequence[int]]], *, batch_size: int = 8,
                     temperature: float = 1.0, backend: str = "auto", max_length: int | None = None,
                     pad_token_id: int = 0, vocab_size: int | None = None) -> dict[str, TokenDivergences]:
    """Per-task :class:`TokenDivergences` over every prefix of every token list of each task.

    Both models run in eval mode (every submodule's mode restored after).

    Args:
        task_tokens: task name -> list of token-id lists (each truncated to its first ``max_length`` tokens; a list
            left with fewer than 2 tokens has no prefix to teacher-force and is skipped).
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
