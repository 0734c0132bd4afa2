"""The automatic number of drafts per round (``num_draft_tokens="auto"``).

Before each round the controller picks the K that maximises expected tokens per second,
``E[N](alpha, K) / t(K)`` with ``E[N] = (1 - alpha^(K+1)) / (1 - alpha)`` (1 for K = 0, plain decoding) and
``t(K)`` the measured time of a round of K drafts. ``alpha`` is the per-position acceptance estimated from the
acceptance tests of recent rounds (exponentially decayed counts, started from a weak prior), so a pair whose drafter
is rarely accepted falls back to plain decoding and costs about what plain decoding costs. While it decodes without
drafts it learns nothing about alpha, so it runs one round of the smallest K at least every ``probe_every`` rounds.
"""

from __future__ import annotations

from collections.abc import Mapping

AUTO_DRAFT_LENGTHS = (0, 1, 2, 3, 4, 6, 8)  # the K values "auto" chooses from


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """E[N] = 1 + alpha + ... + alpha^K: tokens a round of K drafts yields at per-position acceptance alpha."""
    return sum(alpha**j for j in range(num_drafts + 1))


class DraftLengthController:
    """Chooses K per round from measured round times ``{K: seconds}`` and the observed acceptance."""

    def __init__(self, round_seconds: Mapping[int, float], *, prior_alpha: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.9, probe_every: int = 16):
        if 0 not in round_seconds or len(round_seconds) < 2:
            raise ValueError("round_seconds must time K = 0 and at least one K > 0")
        self.round_seconds = dict(round_seconds)
        self.prior_alpha, self.prior_weight, self.decay = prior_alpha, prior_weight, decay
        self.probe_every = probe_every
        self.accepted = self.attempted = 0.0
        self.plain_streak = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_alpha * self.prior_weight) / (self.attempted + self.prior_weight)

    def choose(self) -> int:
        alpha = self.alpha
        best = max(self.round_seconds, key=lambda k: (expected_tokens(alpha, k) / self.round_seconds[k], -k))
        if best == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                best = min(k for k in self.round_seconds if k > 0)
        if best:
            self.plain_streak = 0
        return best

    def observe(self, accepted: int, attempted: int) -> None:
        """Acceptance tests of the last round: ``accepted`` of ``attempted`` draft positions (pooled over rows)."""
        if attempted:
            self.accepted = self.decay * self.accepted + accepted
            self.attempted = self.decay * self.attempted + attempted
