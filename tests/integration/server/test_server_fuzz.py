"""Fuzzing the engine server: nothing a client sends gets a 5xx or harms the engine.

Two generators, both seeded and bounded: schemathesis derives requests for every route from the
server's own /openapi.json (valid ones and ones that break the schema), and hypothesis builds
hostile JSON bodies for completions and chat (NaN and Infinity literals, 70-bit integers, token
ids outside the vocabulary, wrong types, deep nesting, min/max conflicts). After each run the
server must still be healthy, idle (no request or KV block left behind) and answer a normal
request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fuzzing import fuzz_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from server_helpers import SERVED_NAME, ServerProcess, assert_sound, tiny_server_args

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.server import ServerSettings, create_app

pytestmark = pytest.mark.slow  # about 40 s of seeded fuzzing

# A short context and few choices per request keep each generated request cheap.
FUZZ_MAX_MODEL_LEN = 48
FUZZ_MAX_CHOICES = 8
VOCAB = 256  # tinymodels' vocabulary

FUZZ_SETTINGS = fuzz_settings(max_examples=25)


@pytest.fixture(scope="module")
def fuzz_server(launch: Callable[..., ServerProcess], tiny_chat_dir: Path) -> ServerProcess:
    args = tiny_server_args(tiny_chat_dir)
    args += ["--max-model-len", str(FUZZ_MAX_MODEL_LEN)]
    args += ["--max-request-choices", str(FUZZ_MAX_CHOICES)]
    return launch(args)


# -- schemathesis, from the server's OpenAPI document ------------------------------------------

# The document the server serves at /openapi.json, built here so that schemathesis can create
# one test per route when the tests are collected; the first test checks it is the served one.
OPENAPI = create_app(ServerSettings(model_names=[SERVED_NAME]), LLMEngine).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
# Examples and random fuzzing (valid and schema-breaking requests), bounded by max_examples;
# the exhaustive boundary "coverage" phase alone would send over a thousand requests.
schema.config.phases.update(phases=["examples", "fuzzing"])


def test_openapi_document_is_the_served_one(fuzz_server: ServerProcess) -> None:
    served = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json()
    assert served == OPENAPI
    body = served["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")


@schema.parametrize()
@FUZZ_SETTINGS
def test_openapi_routes_never_answer_5xx(
    fuzz_server: ServerProcess, case: schemathesis.Case
) -> None:
    response = case.call_and_validate(
        base_url=fuzz_server.base_url, checks=[not_a_server_error], timeout=60
    )
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]


def test_sound_after_openapi_fuzzing(fuzz_server: ServerProcess) -> None:
    assert_sound(fuzz_server)


# -- hypothesis: hostile bodies for completions and chat ---------------------------------------

huge_int = st.integers(min_value=-(2**70), max_value=2**70)
any_number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), huge_int)
json_leaf = st.one_of(st.none(), st.booleans(), huge_int, any_number, st.text(max_size=12))
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, 2**40), huge_int)
token_ids = st.lists(token_id, min_size=0, max_size=6)


# Valid values for every field...
SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, FUZZ_MAX_CHOICES),
    "max_tokens": st.integers(1, FUZZ_MAX_MODEL_LEN // 2),
    "min_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, VOCAB + 5),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.text(min_size=1, max_size=6),
    "return_token_ids": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
in_vocab_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": st.one_of(
        st.text(min_size=1, max_size=20), in_vocab_ids, st.lists(in_vocab_ids, max_size=2)
    ),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=20)}
)
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, FUZZ_MAX_MODEL_LEN // 2),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
}
# ...values of the right type that only the server can judge wrong...
EDGE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(FUZZ_MAX_CHOICES + 1, 2**63 - 1),
    "max_tokens": st.integers(FUZZ_MAX_MODEL_LEN, 2**63 - 1),
    "min_tokens": st.integers(1, 2**63 - 1),
    "stop_token_ids": st.lists(token_id, min_size=1, max_size=4),
    "prompt": st.one_of(st.just(""), st.lists(token_ids, max_size=3), token_ids),
    "messages": st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "x"]), json_value), max_size=3
    ),
    "stop": st.lists(st.text(max_size=2), max_size=70),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-100, 100), max_size=2),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_value, max_size=2),
    "cache_salt": st.just(""),
    "top_logprobs": st.integers(6, 2**63 - 1),
    "logprobs": st.integers(21, 2**63 - 1),
}
# ...and anything at all: NaN, Infinity, 70-bit integers, wrong types.
HOSTILE_VALUE = st.one_of(any_number, json_value)


def bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    # Every field present, as null (the default) or a valid value, so fields meet each other.
    valid = st.fixed_dictionaries(
        {"model": st.just(SERVED_NAME), **{k: st.none() | v for k, v in fields.items()}}
    ).map(lambda body: {k: v for k, v in body.items() if v is not None})

    def with_one(values: st.SearchStrategy[tuple[str, Any]]) -> st.SearchStrategy[dict]:
        return st.tuples(valid, values).map(lambda t: {**t[0], t[1][0]: t[1][1]})

    edges = [st.tuples(st.just(k), v) for k, v in EDGE_VALUES.items() if k in fields]
    one_edge = with_one(st.one_of(edges))
    two_edges = with_one(st.one_of(edges)).flatmap(
        lambda body: st.one_of(edges).map(lambda kv: {**body, kv[0]: kv[1]})
    )
    one_hostile = with_one(st.tuples(st.sampled_from(sorted(fields)), HOSTILE_VALUE))
    all_hostile = st.fixed_dictionaries(
        {"model": st.just(SERVED_NAME)}, optional=dict.fromkeys(fields, HOSTILE_VALUE)
    )
    # json.dumps writes NaN and Infinity literals, as a careless client's encoder does.
    encoded = st.one_of(valid, one_edge, one_edge, two_edges, one_hostile, all_hostile).map(
        lambda body: json.dumps(body).encode()
    )
    nested = st.integers(1, 20_000).map(
        lambda depth: b'{"prompt": "hi", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    )
    return st.one_of(encoded, encoded, encoded, encoded, nested, st.binary(max_size=40))


def _post_raw(server: ServerProcess, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=60)


def _assert_answered(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert "\n\n" in response.text and '"code":5' not in response.text, response.text


@pytest.mark.parametrize(
    ("path", "fields"),
    [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)],
    ids=["completions", "chat"],
)
def test_hostile_bodies_never_answer_5xx(
    fuzz_server: ServerProcess, path: str, fields: dict[str, st.SearchStrategy[Any]]
) -> None:
    @given(body=bodies(fields))
    @settings(FUZZ_SETTINGS, max_examples=120)
    def run(body: bytes) -> None:
        _assert_answered(_post_raw(fuzz_server, path, body))

    run()
    assert_sound(fuzz_server)
