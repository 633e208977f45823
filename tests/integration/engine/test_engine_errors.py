"""Bad input raises a clear ValueError naming the problem; nothing leaks, the engine goes on."""

from __future__ import annotations

import pytest
from tinymodels import float32_engine

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    path, _ = tiny_model("llama-mha")
    return float32_engine(path, num_kv_blocks=16, max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt must not be empty"),
        ("", "prompt must not be empty"),
        ("text", "without a tokenizer"),
        (list(range(64)), "max_model_len is 64"),
        ([1, 2, 256], r"token ids must be in \[0, 256\)"),
        ([1, -1], r"token ids must be in \[0, 256\)"),
        ([1.5, 2], "string or a list of token ids"),
        (None, "string or a list of token ids"),
        ([True, 2], "string or a list of token ids"),
    ],
)
def test_bad_prompts(engine: LLMEngine, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, OK)
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0


def test_duplicate_ids_and_n_are_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", [1, 2, 3], OK)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], OK)
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request("many", [1, 2], SamplingParams(n=2))
    while engine.has_unfinished_requests():
        engine.step()
    # The id is free again once its request is done.
    engine.add_request("dup", [4], OK)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_cache_usage == 0.0


def test_generation_stops_at_max_model_len(engine: LLMEngine) -> None:
    engine.add_request("long", list(range(60)), SamplingParams(temperature=0.0, max_tokens=50))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length"
    assert len(final.token_ids) == 4  # 60 + 4 = max_model_len


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_model_len": 5000}, "exceeds the model's limit"),
        ({"num_kv_blocks": 2, "max_model_len": 64}, "fewer than max_model_len"),
        ({"dtype": "int3"}, "dtype"),
    ],
)
def test_bad_engine_settings(tiny_model, kwargs: dict, message: str) -> None:
    path, _ = tiny_model("llama-mha")
    settings = {"dtype": "float32", "skip_tokenizer_init": True, "num_kv_blocks": 64}
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), **settings)


def test_unknown_model_reference() -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")


def test_generate_rejects_mismatched_params(tiny_model) -> None:
    path, _ = tiny_model("llama-mha")
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[1], [2], [3]], [OK, OK])
    # A bad prompt in the middle of a batch leaves no request behind.
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate([[1, 2], [], [3]], OK)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().kv_cache_usage == 0.0
    assert llm.generate([[1, 2]], OK)[0].outputs[0].token_ids
