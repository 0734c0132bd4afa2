"""Logits processors whose effect depends on the tokens so far, applied identically to the drafter and the verifier.

transformers applies, in this order, to the fp32 logits of the next token (``_get_logits_processor``):

* ``repetition_penalty`` θ (``RepetitionPenaltyLogitsProcessor``): for every token id x in the context,
  ``l_x <- l_x * θ`` if ``l_x < 0`` else ``l_x / θ``. The context is every generated token and the prompt: from the
  row's first attended column on where the installed transformers passes the left padding as
  ``prompt_ignore_length`` (newer 5.x releases), the whole padded row, pad ids included, where it does not (5.17 and
  earlier), so that the penalty is the installed ``generate``'s.
* ``min_new_tokens`` m (``MinNewTokensLengthLogitsProcessor``; ``min_length`` folds into it): while fewer than m
  tokens have been generated, every eos logit is ``-inf``.

then temperature, top-k and top-p when sampling. Speculative decoding scores K + 1 positions in one verifier call and
drafts K tokens in a row, so position j of a round is processed with the context of the committed tokens plus the
round's drafts before j, and with ``generated + j`` tokens generated: the drafter's law q_j and the verifier's p_j are
exactly what a token-by-token decoder would use, and rejection sampling stays exact.

State lives on the device (``seen`` [B, V + 1] bool, the penalty, the minimum count and the eos mask), so a static
round captured in a CUDA graph reads no host value; each round's processors are tensor operations.
"""

from __future__ import annotations

import functools
import inspect

import torch


class TokenProcessors:
    """Device state of the token-dependent processors of B rows over a vocabulary of V ids.

    ``seen`` [B, V + 1] bool: ids in each row's committed context (column V is a sink for masked writes).
    ``penalty`` [] float32 θ, ``min_new`` [] int64 m, ``eos_mask`` [V] bool (the eos ids). The tensors are refilled in
    place by :meth:`reset`, so captured rounds keep reading them.
    """

    def __init__(self, batch: int, vocab: int, device: torch.device):
        self.vocab = vocab
        self.seen = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=device)  # [B, V + 1] bool
        self.penalty = torch.ones((), dtype=torch.float32, device=device)  # [] float32
        self.min_new = torch.zeros((), dtype=torch.int64, device=device)  # [] int64
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V] bool

    def reset(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, penalty: float | None, min_new: int,
              eos_ids: list[int]) -> None:
        """Context of the prompts ([B, L] int64, left-padded; mask [B, L]) and the call's settings."""
        self.seen.copy_(prompt_context(input_ids, attention_mask, self.vocab))
        self.penalty.fill_(1.0 if penalty is None else penalty)
        self.min_new.fill_(min_new)
        self.eos_mask.zero_()
        if eos_ids:
            self.eos_mask[torch.tensor(eos_ids, device=self.eos_mask.device)] = True

    def process(self, logits: torch.Tensor, seen: torch.Tensor | None, generated_before: torch.Tensor | None
                ) -> torch.Tensor:
        """fp32 logits [B, T, V] after the penalty (when ``seen`` [B, T, V] or [B, 1, V] bool is given) and the eos
        ban (when ``generated_before`` [B, T] int64 is given)."""
        out = logits.float()
        if seen is not None:
            out = apply_repetition_penalty(out, seen, self.penalty)
        if generated_before is not None:
            out = ban_eos(out, generated_before, self.min_new, self.eos_mask)
        return out

    def commit(self, tokens: torch.Tensor, emit: torch.Tensor) -> None:
        """Adds the emitted tokens ([B, T] int64, ``emit`` [B, T] bool) to the context."""
        mark_seen(self.seen, tokens, emit)


@functools.cache
def penalty_skips_left_padding() -> bool:
    """Whether the installed transformers leaves each row's left padding out of the repetition penalty's context
    (its ``_get_logits_processor`` passes ``prompt_ignore_length``); older releases penalise the pad ids too."""
    from transformers.generation.utils import GenerationMixin

    try:
        return "prompt_ignore_length" in inspect.getsource(GenerationMixin._get_logits_processor)
    except (OSError, TypeError):  # no source shipped: the current behaviour
        return True


def prompt_context(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: int,
                   skip_left_padding: bool | None = None) -> torch.Tensor:
    """[B, V + 1] bool: the ids of each prompt ([B, L] int64, mask [B, L]) that the repetition penalty sees, as in
    the installed transformers: from the row's first attended column on, or the whole row with its pad ids when
    ``skip_left_padding`` is False (default: :func:`penalty_skips_left_padding`)."""
    batch, width = input_ids.shape
    if skip_left_padding is None:
        skip_left_padding = penalty_skips_left_padding()
    mask = attention_mask != 0
    first = mask.to(torch.int64).argmax(dim=1)  # [B] first attended column
    if not skip_left_padding:
        first = torch.zeros_like(first)
    keep = torch.arange(width, device=input_ids.device)[None, :] >= first[:, None]
    ids = torch.where(keep, input_ids.to(torch.int64).clamp(0, vocab), vocab)  # (ids past V cannot be emitted)
    seen = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=input_ids.device)
    return seen.scatter_(1, ids, True)


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor, emit: torch.Tensor) -> None:
    """``seen`` [B, V + 1] bool |= one-hot of ``tokens`` [B, T] where ``emit`` [B, T] bool (in place)."""
    sink = seen.shape[1] - 1
    seen.scatter_(1, torch.where(emit, tokens.clamp(0, sink), sink), True)


def draft_contexts(seen: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[B, K + 1, V] bool: the context of each verifier position of a round, ``seen`` [B, V + 1] plus the drafts
    ([B, K] int64) before the position (position j follows drafts 0 .. j-1)."""
    batch, num_drafts = drafts.shape
    sink = seen.shape[1] - 1
    position = torch.arange(num_drafts + 1, device=drafts.device)
    before = torch.arange(num_drafts, device=drafts.device)[None, :] < position[:, None]  # [K + 1, K]
    ids = torch.where(before[None], drafts[:, None, :].clamp(0, sink), sink)  # [B, K + 1, K]
    context = seen[:, None, :].expand(batch, num_drafts + 1, sink + 1).clone()
    context.scatter_(2, ids, True)
    return context[..., :sink]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty: fp32 ``logits`` [..., V] with every id in ``seen`` [..., V] bool
    (broadcast) scaled, ``l * θ`` where ``l < 0`` else ``l / θ``."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def ban_eos(logits: torch.Tensor, generated_before: torch.Tensor, min_new: torch.Tensor,
            eos_mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, T, V] with the eos ids (``eos_mask`` [V] bool) at ``-inf`` where fewer than ``min_new`` tokens
    were generated before the position (``generated_before`` [B, T] int64)."""
    banned = (generated_before < min_new)[..., None] & eos_mask
    return logits.masked_fill(banned, float("-inf"))


def token_logprobs(processed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] float32 ``log_softmax(processed)[token]``: ``processed`` [B, T, V] the logits a token was drawn from
    (after processors and temperature), ``tokens`` [B, T] int64 (-1 entries read id 0; callers mask them)."""
    log_probs = torch.log_softmax(processed.float(), dim=-1)
    return log_probs.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
