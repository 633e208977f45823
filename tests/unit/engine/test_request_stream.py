"""A request stream hands DELTA outputs to its consumer; one that falls behind gets the deltas
it missed merged into one, and `final()` gets each request's whole output."""

from __future__ import annotations

import asyncio

import pytest

from fleetllm.engine.async_engine import AsyncEngine, EngineRequest, RequestStream
from fleetllm.engine.request import CompletionOutput, Logprob, RequestOutput
from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams

DELTA = SamplingParams(output_kind=RequestOutputKind.DELTA)


def delta(rid: str, text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    logprobs = [{i: Logprob(-1.0, 1)} for i in ids]
    completion = CompletionOutput(0, text, ids, -1.0 * ids[-1], logprobs, finish)
    return RequestOutput(rid, None, [1], [completion], finished=finish is not None)


def stream(n: int) -> RequestStream:
    requests = [EngineRequest(f"r{i}", [1], DELTA, 0.0) for i in range(n)]
    return RequestStream(AsyncEngine(lambda: None), requests)  # type: ignore[arg-type,return-value]


def test_a_late_consumer_gets_the_missed_deltas_merged() -> None:
    async def run() -> None:
        s = stream(2)
        s._update(0, delta("r0", "He", [5]))
        s._update(1, delta("r1", "A", [7]))
        s._update(0, delta("r0", "llo", [6, 8]))
        updates = s.updates()
        batch = await anext(updates)
        assert [i for i, _ in batch] == [0, 1]
        merged = batch[0][1].outputs[0]
        assert (merged.text, merged.token_ids) == ("Hello", [5, 6, 8])
        assert merged.logprobs == [
            {5: Logprob(-1.0, 1)},
            {6: Logprob(-1.0, 1)},
            {8: Logprob(-1.0, 1)},
        ]
        assert merged.cumulative_logprob == -8.0  # the latest, not a sum
        s._update(0, delta("r0", "!", [9], "stop"))
        s._update(1, delta("r1", "", [3], "length"))
        batch = await anext(updates)
        assert [(i, o.outputs[0].text, o.finished) for i, o in batch] == [
            (0, "!", True),
            (1, "", True),
        ]
        with pytest.raises(StopAsyncIteration):
            await anext(updates)
        assert s.num_output_tokens == [4, 2]

    asyncio.run(run())


def test_final_is_each_whole_output_in_request_order() -> None:
    async def run() -> None:
        s = stream(2)
        s._update(1, delta("r1", "x", [1]))
        s._update(0, delta("r0", "a", [2]))
        s._update(1, delta("r1", "y", [3], "stop"))
        s._update(0, delta("r0", "b", [4], "length"))
        outs = await s.final()
        assert [(o.request_id, o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == [
            ("r0", "ab", [2, 4]),
            ("r1", "xy", [1, 3]),
        ]
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "stop"]

    asyncio.run(run())


def test_only_delta_requests_are_accepted() -> None:
    engine = AsyncEngine(lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="DELTA"):
        engine.submit([EngineRequest("r", [1], SamplingParams(), 0.0)])
