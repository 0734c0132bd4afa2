"""``stop_strings`` for :func:`specdec.generate`, with transformers' ``StopStringCriteria`` semantics.

A row stops after the token that completes a stop string (that token is kept): transformers checks, after every new
token, whether the text of the sequence (padded prompt included) ends inside that token with a stop string, using
each token's own string from the tokenizer's vocabulary. A round of speculative decoding emits up to K + 1 tokens at
once, so after a round every emitted position is checked as if it were the last token (the ``StopStringCriteria``
itself runs on a window of the tokens ending there), the row is cut after the first one that completes a stop string
and marked finished. All of it is tensor operations on the sequence's device, outside the captured round.
"""

from __future__ import annotations

from typing import Any

import torch

_FILLER = 2**62  # an id past every vocabulary: the criteria maps it to an entry that matches nothing


class StopStringChecker:
    """transformers' ``StopStringCriteria(tokenizer, stop_strings)`` applied at every position a round emitted."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]):
        from transformers.generation.stopping_criteria import StopStringCriteria

        if tokenizer is None:
            raise ValueError("stop_strings needs tokenizer= (the tokenizer of the models, to read the tokens' text), "
                             "as in transformers' generate")
        self.criteria = StopStringCriteria(tokenizer, list(stop_strings))
        self.window = int(self.criteria.maximum_token_len)  # at most one token per character of a stop string

    def first_stop(self, sequence: torch.Tensor, start: torch.Tensor, count: torch.Tensor, positions: int
                   ) -> torch.Tensor:
        """[B] int64: the index (0 .. positions - 1) of the first token emitted this round that completes a stop
        string, or ``positions`` where none does.

        ``sequence`` [B, S] int64: padded prompt then the generated tokens; ``start`` [B] int64: the column of the
        round's first emitted token; ``count`` [B] int64: tokens the row emitted this round (<= ``positions``).
        """
        batch = sequence.shape[0]
        device = sequence.device
        index = torch.arange(positions, device=device)
        last = start[:, None] + index  # [B, T] column of each candidate last token
        columns = last[..., None] - self.window + 1 + torch.arange(self.window, device=device)  # [B, T, W]
        tokens = sequence.gather(1, columns.clamp(0, sequence.shape[1] - 1).reshape(batch, -1))
        tokens = torch.where(columns.reshape(batch, -1) >= 0, tokens, _FILLER).reshape(-1, self.window)
        hit = self.criteria(tokens, None).reshape(batch, positions) & (index < count[:, None])
        return torch.where(hit.any(dim=1), hit.to(torch.int64).argmax(dim=1), positions)
