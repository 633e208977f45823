"""Suite-wide setup that must happen before any test module is imported."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so their tests
# check the same kernel code. The mode is fixed when Triton is first imported, and test
# dependencies (transformers) import it early: it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
