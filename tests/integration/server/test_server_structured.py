"""Structured outputs and tool calls through the server, on the tiny chat model (random
weights, SmolLM2's tokenizer): every field that carries a constraint, on both endpoints,
streamed and whole, with n > 1; refusals naming the field; aborts mid-grammar; tool-call
histories and streamed tool calls."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import (
    SERVED_NAME,
    ServerProcess,
    assert_sound,
    parse_sse,
    post,
    tiny_server_args,
    wait_until,
)

from fleetllm.engine import grammar

REGEX = r"[0-9]{3}-(yes|no)"
CHOICES = ["alpha", "beta gamma", "delta"]


@pytest.fixture(scope="module")
def tool_server(launch: Callable[..., ServerProcess], tiny_chat_dir: Path) -> ServerProcess:
    return launch(
        tiny_server_args(tiny_chat_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    )


def texts(server: ServerProcess, path: str, body: dict[str, Any]) -> list[str]:
    """Each choice's text, whole or streamed (the stream's pieces put together)."""
    response = post(server, path, {"model": SERVED_NAME, "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    chat = path.endswith("chat/completions")
    n = body.get("n", 1)
    if not body.get("stream"):
        choices = response.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["stop"] * n
        return [c["message"]["content"] if chat else c["text"] for c in choices]
    out = [""] * n
    for chunk in parse_sse(response.text):
        for c in chunk["choices"]:
            out[c["index"]] += (c["delta"].get("content") if chat else c["text"]) or ""
    return out


CONSTRAINTS = [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": 'start: "x" ("+" "x")~2'}}, lambda t: t == "x+x+x"),
    ({"guided_grammar": 'start: "a"+ "b"'}, lambda t: re.fullmatch("a+b", t)),
    (
        {"guided_json": {"enum": [1, "two", None]}, "guided_whitespace_pattern": " "},
        lambda t: json.loads(t) in (1, "two", None),
    ),
    (
        {"structured_outputs": {"json": {"type": "boolean"}, "disable_any_whitespace": True}},
        lambda t: t in ("true", "false"),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
            "enum": ["on", "off"]}}}},
        lambda t: json.loads(t) in ("on", "off"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "check"), CONSTRAINTS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_constraint_field_holds_on_both_endpoints(
    server: ServerProcess, fields: dict, check: Callable, path: str, stream: bool
) -> None:
    prompt = {"prompt": "Answer:"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Answer."}]}  # fmt: skip
    body = {**prompt, **fields, "n": 3, "temperature": 1.0, "seed": 5, "stream": stream}
    for text in texts(server, path, body):
        assert check(text), text


def test_json_object_and_structural_tags(server: ServerProcess) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 30,
        "temperature": 0.0,
        "structured_outputs": {"json_object": True, "disable_any_whitespace": True},
    }
    response = post(server, "/v1/completions", body).json()["choices"][0]
    if response["finish_reason"] == "stop":
        assert isinstance(json.loads(response["text"]), dict)
    else:  # a random model may fill an object for ever: what it wrote is an object's start
        assert response["text"].startswith("{")
    tag = {
        "type": "structural_tag",
        "triggers": ["<f>"],
        "structures": [{"begin": "<f>", "schema": {"enum": [7]}, "end": "</f>"}],
    }
    body = {"prompt": "x", "max_tokens": 5, "response_format": tag}
    assert post(server, "/v1/completions", body).status_code == 200


BAD = [
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs", "objekt"),
    ({"guided_json": "{no"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json"),
    ({"guided_regex": "a" * (grammar.MAX_SPEC_BYTES + 1)}, "guided_regex", "limit"),
    ({"guided_choice": ["x" * 2000] * 20}, "guided_choice", "limit"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_constraints_that_cannot_be_honoured_are_refused_naming_the_field(
    server: ServerProcess, fields: dict, param: str, message: str, path: str
) -> None:
    prompt = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
    response = post(server, path, {"model": SERVED_NAME, **prompt, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.recursive(
    st.one_of(st.sampled_from(["string", "integer", "objekt", 3, None]), st.text(max_size=5)),
    lambda inner: st.dictionaries(
        st.sampled_from(["type", "properties", "items", "enum", "$ref", "minimum", "pattern"]),
        inner, max_size=3),
    max_leaves=8))  # fmt: skip
def test_random_schemas_get_an_answer_or_a_400_never_a_failure(
    server: ServerProcess, schema: Any
) -> None:
    body = {"model": SERVED_NAME, "prompt": "x", "max_tokens": 3, "guided_json": schema}
    response = post(server, "/v1/completions", body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "guided_json"


def test_an_aborted_request_mid_grammar_holds_nothing(server: ServerProcess) -> None:
    """Streams under a grammar dropped after their first chunk: blocks freed, and the server
    answers the next constrained request as usual."""
    body = {
        "model": SERVED_NAME,
        "prompt": "x",
        "max_tokens": 400,
        "stream": True,
        "n": 4,
        "ignore_eos": True,
        "guided_regex": "[a-z ]{1,1000}",
    }
    for _ in range(3):
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="aborted")
    assert_sound(server)
    assert texts(server, "/v1/completions", {"prompt": "x", "guided_choice": CHOICES})[0] in CHOICES


def test_a_request_whose_masks_leave_no_token_finishes_cleanly(server: ServerProcess) -> None:
    body = {"prompt": "x", "guided_choice": ["yes"], "allowed_token_ids": [7], "max_tokens": 5}
    choice = post(server, "/v1/completions", {"model": SERVED_NAME, **body}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert_sound(server)


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
CALL = '<tool_call>{"name": "lookup", "arguments": {"q": "cats"}}</tool_call>'


def test_auto_tool_calls_are_parsed_whole_and_streamed(tool_server: ServerProcess) -> None:
    """The hermes parser over an output forced to hold a call (a regex constraint, which
    vLLM allows beside tool_choice "auto")."""
    regex = re.escape("Sure. " + CALL)
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "cats?"}],
        "tools": TOOLS,
        "structured_outputs": {"regex": regex},
        "max_tokens": 80,
    }
    whole = post(tool_server, "/v1/chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Sure. "
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"q": "cats"}'}
    events = parse_sse(post(tool_server, "/v1/chat/completions", {**body, "stream": True}).text)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert content == "Sure. "
    assert calls[0]["function"] == {"name": "lookup", "arguments": ""} and calls[0]["id"]
    assert "".join(t["function"].get("arguments", "") for t in calls) == '{"q": "cats"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_call_histories_are_rendered(tool_server: ServerProcess) -> None:
    history = [
        {"role": "user", "content": "cats?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"q": "cats"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Cats purr."},
    ]  # fmt: skip
    body = {"model": SERVED_NAME, "messages": history, "tools": TOOLS, "max_tokens": 3}
    response = post(tool_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    prompt = post(tool_server, "/tokenize", {"messages": history, "tools": TOOLS}).json()
    text = post(tool_server, "/detokenize", {"tokens": prompt["tokens"]}).json()["prompt"]
    assert "Cats purr." in text
    broken = [history[0], {**history[1], "tool_calls": [{"function": {"name": "lookup",
              "arguments": "{not json"}}]}]  # fmt: skip
    response = post(tool_server, "/v1/chat/completions", {**body, "messages": broken})
    assert response.status_code == 400 and "arguments is not JSON" in response.text
    no_content = [{"role": "user", "content": None}]
    response = post(tool_server, "/v1/chat/completions", {**body, "messages": no_content})
    assert response.status_code == 400


def test_tool_choices_without_the_servers_flags_are_refused(server: ServerProcess) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "lookup"}}):
        response = post(server, "/v1/chat/completions", {**body, "tool_choice": choice})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    response = post(server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert response.status_code == 200
