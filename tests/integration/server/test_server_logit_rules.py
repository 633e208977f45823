"""logit_bias, allowed_token_ids and bad_words over HTTP, on completions and chat: honoured,
checked against the vocabulary, and refused with 400 naming the field when out of range."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import SERVED_NAME, ServerProcess, post

COMPLETION = {"model": SERVED_NAME, "prompt": "The sea is", "max_tokens": 6, "temperature": 0}
CHAT = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "The sea is"}],
    "max_tokens": 6,
    "temperature": 0,
}


def token_ids(server: ServerProcess, path: str, body: dict) -> list[int]:
    response = post(server, path, {**body, "return_token_ids": True, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_rules_are_honoured(server: ServerProcess, path: str, body: dict) -> None:
    plain = token_ids(server, path, body)
    forced = token_ids(server, path, {**body, "logit_bias": {"4321": 100}})
    assert forced == [4321] * len(forced)
    allowed = [17, 400, 9000]
    assert set(token_ids(server, path, {**body, "allowed_token_ids": allowed})) <= set(allowed)
    # Ban the greedy answer's first token as a word: the answer changes and never holds it.
    first = httpx.post(
        f"{server.base_url}/detokenize", json={"tokens": plain[:1]}, timeout=30
    ).json()["prompt"]
    banned = token_ids(server, path, {**body, "bad_words": [first.strip() or first]})
    assert banned[0] != plain[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"49152": 1}),  # outside the vocabulary
        ("logit_bias", {"12": 100.5}),
        ("logit_bias", {"twelve": 1}),
        ("allowed_token_ids", [1, 10**9]),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
    ],
)
def test_bad_rules_are_refused_by_name(server: ServerProcess, field: str, value: object) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        response = post(server, path, {**body, field: value})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
