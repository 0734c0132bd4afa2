"""Test session setup.

Without a CUDA device the Triton kernels run in Triton's interpreter; the variable must be set before any module
that defines a ``@triton.jit`` kernel is imported, hence here, first.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # test helpers: models.py, stats.py

requires_cuda = __import__("pytest").mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
