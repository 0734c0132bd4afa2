"""Shared test setup.

Without a CUDA device the Triton kernels run in Triton's interpreter; the variable must be set before any module
that defines a ``@triton.jit`` kernel is imported, hence here, first.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # test helpers: models.py, stats.py



@pytest.fixture(scope="module")
def one_torch_thread():
    """Pin torch to one thread for a module: tiny models train faster without thread hand-offs on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
