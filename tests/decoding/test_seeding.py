"""Seeds derived for the batches of one seeded run."""

from specdec._seeding import derive_seed


def test_derived_seeds_are_reproducible_independent_and_in_range():
    assert derive_seed(3, 0) == derive_seed(3, 0)
    # seed + index would make batch 1 of seed 1 replay batch 0 of seed 2
    assert derive_seed(1, 1) != derive_seed(2, 0)
    seeds = {derive_seed(s, b) for s in range(20) for b in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(0, "task-a", 0) != derive_seed(0, "task-b", 0)
