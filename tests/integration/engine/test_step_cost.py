"""A step's own work does not grow with the length of the outputs so far.

Counted, not timed: the Python calls a step makes (C functions included) and the Python
memory it allocates at its peak, for the same batch at output length 50 and 600. A step
that copied each request's output, rescanned its text or rebuilt its block table from the
start would show up in both. (The attention kernels' reads of the KV cache do grow with the
context, as they must; they are single calls into torch, allocating no Python memory.)
"""

from __future__ import annotations

import statistics
import sys
import tracemalloc
from types import FrameType
from typing import Any

import pytest
from tinymodels import write_tiny_chat_model

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams

SHORT, LONG = 50, 600
WINDOW = 16  # steps measured at each length: one block's worth, so block allocation is typical


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = write_tiny_chat_model(tmp_path_factory.mktemp("step-cost"), max_position_embeddings=4096)
    # One thread: the counts do not depend on it, and it never spins waiting for a core.
    llm = LLM(str(path), dtype="float32", max_model_len=800, num_kv_blocks=400, num_threads=1)
    return llm.engine


def batch(kind: RequestOutputKind) -> list[SamplingParams]:
    """Requests that take every per-token path: plain, stop strings (held-back text),
    logprobs with penalties and seeded sampling."""
    common: dict[str, Any] = {"max_tokens": LONG + 2 * WINDOW, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, output_kind=kind, **common),
        SamplingParams(temperature=0.0, stop=["\x00never", "zz\x01"], output_kind=kind, **common),
        SamplingParams(
            temperature=0.8,
            seed=3,
            logprobs=3,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            output_kind=kind,
            **common,
        ),
    ]


def step_cost(engine: LLMEngine) -> tuple[float, float]:
    """Median Python calls and peak Python bytes allocated per step, over WINDOW steps."""
    calls: list[int] = []
    peaks: list[int] = []
    count = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    tracemalloc.start()
    try:
        for _ in range(WINDOW):
            count = 0
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            sys.setprofile(profile)
            try:
                engine.step()
            finally:
                sys.setprofile(None)
            _, peak = tracemalloc.get_traced_memory()
            calls.append(count)
            peaks.append(peak - before)
    finally:
        tracemalloc.stop()
    return statistics.median(calls), statistics.median(peaks)


def run_to(engine: LLMEngine, n: int) -> None:
    while min(len(r.output_token_ids) for r in engine.requests.values()) < n:
        engine.step()


def short_and_long_step_costs(engine: LLMEngine) -> tuple[tuple[float, float], tuple[float, float]]:
    """A step's cost once the outputs are SHORT tokens long and again at LONG; the requests
    are aborted after."""
    try:
        run_to(engine, SHORT)
        short = step_cost(engine)
        run_to(engine, LONG)
        return short, step_cost(engine)
    finally:
        for rid in list(engine.requests):
            engine.abort_request(rid)


def test_step_cost_does_not_grow_with_output_length(engine: LLMEngine) -> None:
    prompt = engine.encode("Tell me a very long story about the sea.")
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        for i, params in enumerate(batch(kind)):
            engine.add_request(f"{kind.name}{i}", prompt, params)
    (short_calls, short_bytes), (long_calls, long_bytes) = short_and_long_step_costs(engine)
    assert long_calls <= short_calls, (short_calls, long_calls)
    assert long_bytes <= short_bytes * 1.05 + 256, (short_bytes, long_bytes)


def test_cumulative_outputs_do_cost_more_as_they_grow(engine: LLMEngine) -> None:
    """The measure sees per-step copies of the outputs: CUMULATIVE outputs are such."""
    prompt = engine.encode("Tell me a very long story about the sea.")
    for i, params in enumerate(batch(RequestOutputKind.CUMULATIVE)):
        engine.add_request(f"c{i}", prompt, params)
    (_, short_bytes), (_, long_bytes) = short_and_long_step_costs(engine)
    # Each request's token list is copied (8 bytes an entry), with the texts and a logprobs
    # list; the peak counts only the copies alive at once, measured at about three lists'
    # worth (13.1 of 13.2 kB), so two lists' worth is the bound that holds on every run.
    assert long_bytes > short_bytes + 2 * 8 * (LONG - SHORT), (short_bytes, long_bytes)


def test_delta_outputs_add_up_to_the_final_output(engine: LLMEngine) -> None:
    prompt = engine.encode("Write a poem about the moon.")
    kinds = {"d": RequestOutputKind.DELTA, "f": RequestOutputKind.FINAL_ONLY}
    for prefix, kind in kinds.items():
        for i, params in enumerate(batch(kind)):
            params.max_tokens = 120
            engine.add_request(f"{prefix}{i}", prompt, params)
    deltas: dict[str, list[Any]] = {}
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id.startswith("d"):
                deltas.setdefault(out.request_id, []).append(out)
            else:
                assert out.finished  # FINAL_ONLY: nothing before the end
                finals[out.request_id] = out
    assert len(finals) == 3
    for i in range(3):
        parts = [o.outputs[0] for o in deltas[f"d{i}"]]
        final = finals[f"f{i}"].outputs[0]
        assert "".join(c.text for c in parts) == final.text
        assert [t for c in parts for t in c.token_ids] == final.token_ids
        assert len(final.token_ids) == 120
        if final.logprobs is not None:
            assert [e for c in parts for e in c.logprobs] == final.logprobs
            assert parts[-1].cumulative_logprob == pytest.approx(final.cumulative_logprob)
        assert parts[-1].finish_reason == final.finish_reason == "length"
        assert all(c.finish_reason is None for c in parts[:-1])
