"""Which decode batch sizes get a CUDA graph, and which graph a batch replays."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleetllm.engine.cuda_graphs import bucket_for, capture_sizes


def test_sizes_are_small_powers_then_multiples_of_eight() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(100_000)[-1] == 512


@given(st.integers(1, 600), st.integers(1, 700))
def test_a_batch_replays_the_smallest_bucket_that_holds_it(max_num_seqs: int, n: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes))
    bucket = bucket_for(n, sizes)
    if n > sizes[-1]:
        assert bucket is None
    else:
        assert bucket is not None and bucket >= n
        assert all(s < n for s in sizes if s < bucket)
    if max_num_seqs <= 512:
        assert bucket_for(max_num_seqs, sizes) is not None  # every batch the engine forms fits
