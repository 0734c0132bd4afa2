"""Independent, reproducible seeds for the parts of one seeded run (batches, tasks)."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *labels: object) -> int:
    """A seed in [0, 2**63) determined by ``seed`` and ``labels`` (e.g. a task name and a batch index).

    Unlike ``seed + index``, runs with different base seeds never share a stream: ``derive_seed(1, 1)`` and
    ``derive_seed(2, 0)`` are unrelated, so batch b of seed s does not replay batch b - 1 of seed s + 1.
    """
    text = "\x1f".join(str(part) for part in (seed, *labels)).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
