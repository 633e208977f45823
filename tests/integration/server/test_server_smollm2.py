"""The real SmolLM2-135M-Instruct (bfloat16, the default dtype) through the server: chat and
completions, streamed and not, equal the offline API's greedy outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import openai
import pytest
import torch
from server_helpers import ServerProcess

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with the server's thread count: matmul reductions may split by thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol_server(launch: Callable[..., ServerProcess]) -> ServerProcess:
    return launch(
        [
            "--model",
            MODEL,
            "--max-model-len",
            "1024",
            "--num-kv-blocks",
            "256",
            "--num-threads",
            "1",
        ]
    )


@pytest.fixture(scope="module")
def smol_offline() -> LLM:
    return LLM(MODEL, max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def smol_client(smol_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol_server.base_url}/v1", api_key="-", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_smollm2_chat_matches_offline(
    smol_client: openai.OpenAI, smol_offline: LLM, stream: bool
) -> None:
    with torch_threads(1):
        (expected,) = smol_offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=24))
    want = expected.outputs[0].text
    assert "Paris" in want  # the real model, really answering
    if stream:
        chunks = smol_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=24, stream=True
        )
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        response = smol_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=24
        )
        got = response.choices[0].message.content or ""
        assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert got == want


def test_smollm2_completion_matches_offline(smol_client: openai.OpenAI, smol_offline: LLM) -> None:
    prompt = "The three primary colors are"
    with torch_threads(1):
        (expected,) = smol_offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    response = smol_client.completions.create(
        model=MODEL, prompt=prompt, temperature=0.0, max_tokens=16
    )
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
