"""A failure raised for one request inside a step fails that request alone: its blocks are freed,
the other requests produce exactly what they produce without it, and the engine goes on. Only
a step in which every request fails and a probe request fails too is an engine fault."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fleetllm.engine import sampler
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import EngineFaultError, LLMEngine
from fleetllm.engine.request import RequestOutput
from fleetllm.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = {"a": [4, 5, 6, 7], "poison": [1, 2, 3], "b": [8, 9, 10, 11, 12, 13]}


@pytest.fixture
def make_engine(tiny_model) -> Callable[..., LLMEngine]:
    path, _ = tiny_model("llama-mha")

    def make(**kwargs: Any) -> LLMEngine:
        settings: dict[str, Any] = {
            "model": str(path),
            "dtype": "float32",
            "skip_tokenizer_init": True,
            "num_kv_blocks": 64,
            "max_model_len": 128,
            "block_size": 4,
        }
        return LLMEngine(EngineConfig(**{**settings, **kwargs}))

    return make


def run(engine: LLMEngine, params: dict[str, SamplingParams] | None = None) -> dict[str, Any]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, (params or {}).get(rid, GREEDY))
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.stats().kv_cache_usage == 0.0
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    return final


@pytest.fixture
def reference(make_engine: Callable[..., LLMEngine]) -> dict[str, list[int]]:
    outs = run(make_engine())
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def assert_only_poison_failed(
    outs: dict[str, RequestOutput], reference: dict[str, list[int]], what: str
) -> None:
    failed = outs["poison"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error is not None and what in failed.error
    for rid in ("a", "b"):
        assert outs[rid].error is None
        assert outs[rid].outputs[0].finish_reason == "length"
        assert outs[rid].outputs[0].token_ids == reference[rid]


def test_forward_failure_mid_generation(
    make_engine: Callable[..., LLMEngine], reference: dict[str, list[int]]
) -> None:
    """The batch fails once the poison request has 3 tokens; it is rerun request by request,
    so the poison request fails and the others advance in the same step."""
    engine = make_engine()
    real_execute = engine.executor.execute
    calls = {"batched": 0, "single": 0}

    def execute(step: Any) -> Any:
        calls["batched" if len(step.request_ids) > 1 else "single"] += 1
        for rid in step.request_ids:
            if rid == "poison" and len(engine.requests[rid].output_token_ids) >= 3:
                raise RuntimeError("simulated kernel failure")
        return real_execute(step)

    engine.executor.execute = execute  # type: ignore[method-assign]
    outs = run(engine)
    assert_only_poison_failed(outs, reference, "RuntimeError: simulated kernel failure")
    assert len(outs["poison"].outputs[0].token_ids) == 3
    assert calls["single"] == 3  # one isolating rerun per request of the failed batch
    assert engine.stats().finished == {"length": 2, "error": 1}


def test_sampler_failure(
    make_engine: Callable[..., LLMEngine],
    reference: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    poison = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=1)
    real_penalize = sampler._penalize

    def penalize(logits: Any, i: int, row: sampler.SamplingRow) -> None:
        if row.params is poison:
            raise IndexError("simulated penalty failure")
        real_penalize(logits, i, row)

    monkeypatch.setattr(sampler, "_penalize", penalize)
    outs = run(make_engine(), {"poison": poison})
    assert_only_poison_failed(outs, reference, "IndexError: simulated penalty failure")
    assert outs["poison"].outputs[0].token_ids == []


def test_token_processing_failure(
    make_engine: Callable[..., LLMEngine], reference: dict[str, list[int]]
) -> None:
    engine = make_engine()
    real_append = engine._append_token

    def append(req: Any, token_id: int, lp: Any) -> None:
        if req.request_id == "poison" and len(req.output_token_ids) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer failure")
        real_append(req, token_id, lp)

    engine._append_token = append  # type: ignore[method-assign]
    outs = run(engine)
    assert_only_poison_failed(outs, reference, "simulated detokenizer failure")


def test_a_broken_engine_is_a_fault(make_engine: Callable[..., LLMEngine]) -> None:
    """Every request fails, and so does the probe: the engine, not the request, is broken."""
    engine = make_engine()

    def broken(step: Any) -> Any:
        raise RuntimeError("device lost")

    engine.executor.execute = broken  # type: ignore[method-assign]
    engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(EngineFaultError, match="probe request: RuntimeError: device lost"):
        engine.step()
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0.0


def test_a_failing_request_sent_again_and_again_never_takes_the_engine_down(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Alone in its steps, a failing request fails every one of them; the probe passes each
    time, so the engine is not blamed, however often the request is sent."""
    engine = make_engine()
    real_execute = engine.executor.execute

    def execute(step: Any) -> Any:
        if any(rid.startswith("bad") for rid in step.request_ids):
            raise RuntimeError("bad request data")
        return real_execute(step)

    engine.executor.execute = execute  # type: ignore[method-assign]
    for i in range(6):
        engine.add_request(f"bad{i}", [1, 2, 3], GREEDY)
        (out,) = engine.step()
        assert out.outputs[0].finish_reason == "error"
    engine.add_request("ok", [1, 2, 3], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().finished == {"error": 6, "length": 1}


@pytest.mark.parametrize(
    ("params", "salt", "message"),
    [
        (SamplingParams(stop_token_ids=[256]), None, r"stop_token_ids .*\[0, 256\), got 256"),
        (SamplingParams(stop_token_ids=[2**70]), None, "stop_token_ids"),
        (SamplingParams(), "", "cache_salt"),
    ],
)
def test_invalid_requests_are_refused_before_a_step(
    make_engine: Callable[..., LLMEngine], params: SamplingParams, salt: str | None, message: str
) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", [1, 2, 3], params, cache_salt=salt)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("repetition_penalty", float("inf")),
        ("min_p", float("-inf")),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop", ["x"] * 65),
    ],
)
def test_sampling_params_refuse_non_finite_and_out_of_range(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cache_salt_keeps_tenants_apart(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    prompt = list(range(20, 33))  # 3 full blocks of 4, and a token

    def cached(rid: str, salt: str | None) -> int:
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        assert final is not None
        return final.num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") == 12
    assert cached("b1", "tenant-b") == 0
    assert cached("n1", None) == 0
    assert cached("n2", None) == 12
