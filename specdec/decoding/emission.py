"""What a round of speculative decoding emits and counts, shared by the static and the eager path.

A round yields ``tokens`` [B, K+1]: the row's accepted drafts, then its recovered or bonus token. A row emits
``tokens[:, :n + 1]`` (n accepted drafts) cut at its first eos and at its remaining budget. Acceptance tests count up
to an emitted eos (none after it) and also past the budget (they were decided). The rule is defined once, in
:func:`specdec.kernels.round_commit_reference.round_emission`; the eager path applies it here, the static path in
its one-launch round commit (:mod:`specdec.kernels.round_commit`).
"""

from __future__ import annotations

from specdec.kernels.round_commit_reference import add_position_counts
from specdec.kernels.round_commit_reference import round_emission as emission

__all__ = ["add_position_counts", "emission"]
