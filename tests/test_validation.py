"""specdec._validation: integer ranges with and without an upper bound, and the messages that name them."""

from __future__ import annotations

import pytest
import torch

from specdec import data
from specdec._validation import check_int_at_least, check_int_range


def test_an_int_without_upper_bound_takes_any_size():
    assert check_int_range(2**63, "n", 0, None) == 2**63
    assert check_int_at_least(2**70, "n", 1) == 2**70
    assert check_int_at_least(torch.tensor(5), "n", 5) == 5
    assert check_int_at_least(None, "n", 1, allow_none=True) is None
    assert data.generate_examples("count", 0) == []


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check_int_at_least(-1, "n", 0), "n must be an integer >= 0, got -1"),
    (lambda: check_int_at_least(2.0, "n", 0), "n must be an integer >= 0, got 2.0"),
    (lambda: check_int_at_least(True, "n", 0, allow_none=True), "n must be None or an integer >= 0, got True"),
    (lambda: check_int_range(0, "n", 1, None, note=" (rows)"), "n must be an integer >= 1 (rows), got 0"),
    (lambda: check_int_range(2**64, "seed", 0, 2**64), "seed must be an int in [0, 2**64), got 18446744073709551616"),
    (lambda: check_int_range(5, "k", 0, 5), "k must be an int in [0, 5), got 5"),
    (lambda: data.generate_examples("count", -1), "num_examples must be an integer >= 0, got -1"),
    (lambda: data.sample_mixture({"count": 1.0}, 2.5), "num_examples must be an integer >= 0, got 2.5"),
])
def test_messages_name_the_argument_and_the_range(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message
