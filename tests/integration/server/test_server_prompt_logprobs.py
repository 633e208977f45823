"""Prompt logprobs over HTTP: an lm-evaluation-harness loglikelihood request (completions,
`echo`, `logprobs: 1`, `max_tokens: 0`) scores the prompt as Hugging Face does in float32;
vLLM's `prompt_logprobs` on completions and chat; streams that ask are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from server_helpers import SERVED_NAME, ServerProcess, post
from transformers import AutoModelForCausalLM

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def hf_model(tiny_chat_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_chat_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log P(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_loglikelihood_request_matches_hf(server: ServerProcess, hf_model: torch.nn.Module) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "echo": True, "logprobs": 1}
    response = post(server, "/v1/completions", {**body, "max_tokens": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    c = answer["choices"][0]
    ids = c["prompt_token_ids"]
    assert c["text"] == PROMPT and c["token_ids"] == [] and c["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    expected = hf_logprobs(hf_model, ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected, strict=True)) < 1e-3
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])  # the token and the best
    assert "".join(lp["tokens"]) == PROMPT
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # With generated tokens after: the prompt's entries lead, the generated ones follow.
    more = post(server, "/v1/completions", {**body, "max_tokens": 3, "ignore_eos": True}).json()
    lp = more["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_prompt_logprobs(server: ServerProcess, path: str) -> None:
    body = {"model": SERVED_NAME, "max_tokens": 2, "prompt_logprobs": 3, "return_token_ids": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    if "prompt_logprobs" in answer:  # chat: on the answer, as vLLM puts it
        entries, ids = answer["prompt_logprobs"], answer["prompt_token_ids"]
    else:
        entries = answer["choices"][0]["prompt_logprobs"]
        ids = answer["choices"][0]["prompt_token_ids"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and len(entry) <= 4
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_what_cannot_be_honoured_is_refused(server: ServerProcess, body: dict, field: str) -> None:
    response = post(server, "/v1/completions", {"model": SERVED_NAME, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
