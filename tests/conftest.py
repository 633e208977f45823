"""Suite-wide setup that must happen before any test module is imported, and suite-wide
fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so their tests
# check the same kernel code. The mode is fixed when Triton is first imported, and test
# dependencies (transformers) import it early: it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Thousands of tiny requests or draws: a thread pool's wake-ups would cost more than the
    work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
