"""Tool calls read out of model text, whole and streamed in random pieces: every format gives
the same calls both ways, and a stream's deltas are OpenAI's (index, id, type and name first,
then the arguments in pieces that add up to the whole answer's)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.protocol import ChatCompletionRequest
from fleetllm.engine.serving_tools import ToolSettings, plan, whole_message
from fleetllm.engine.tool_parsers import CallStream, scanner, whole_calls
from fleetllm.errors import APIError

names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
leaves = st.one_of(
    st.integers(-1000, 1000), st.booleans(), st.none(), st.text(max_size=12), st.floats(-1, 1)
)
args = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.recursive(leaves, lambda inner: st.lists(inner, max_size=3), max_leaves=4),
    max_size=4,
)
calls = st.lists(st.tuples(names, args), min_size=1, max_size=3)
spacing = st.sampled_from(["", " ", "\n", "  "])


def render(fmt: str, content: str, items: list[tuple[str, dict]], sp: str) -> str:
    if fmt == "hermes":
        body = "".join(
            f"<tool_call>{sp}{json.dumps({'name': n, 'arguments': a})}{sp}</tool_call>{sp}"
            for n, a in items
        )
        return content + body
    if fmt == "llama3_json":
        return f";{sp}".join(json.dumps({"name": n, "parameters": a}) for n, a in items)
    return json.dumps([{"name": n, "parameters": a} for n, a in items], indent=len(sp) or None)


def stream(fmt: str, text: str, cuts: list[int], name: str | None = None) -> tuple[str, list]:
    state = CallStream(scanner(fmt, name))
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, deltas = "", []
    for start, end in itertools.pairwise(bounds):
        piece, new = state.feed(text[start:end], final=end == len(text))
        content += piece
        deltas += new
    return content, deltas


def calls_from_deltas(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out: dict[int, list[str]] = {}
    for d in deltas:
        i = d["index"]
        if i not in out:  # a call's first delta introduces it, OpenAI's way
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert d["id"].startswith("call_") and d["function"]["arguments"] == ""
            assert i == len(out)
            out[i] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            assert d["function"]["arguments"]
            out[i][1] += d["function"]["arguments"]
    return [(n, a) for n, a in out.values()]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["hermes", "llama3_json", "required"]),
    st.text(alphabet="abc .,!\n<", max_size=20),
    calls,
    spacing,
    st.lists(st.integers(0, 10_000), max_size=30),
)
def test_streamed_calls_are_the_whole_answers_calls(
    fmt: str, content: str, items: list, sp: str, cuts: list[int]
) -> None:
    if fmt != "hermes":
        content = ""
    text = render(fmt, content, items, sp)
    scan = scanner(fmt)(text)
    whole = whole_calls(scan)
    assert whole is not None
    assert [(c.name, json.loads(c.arguments)) for c in whole] == items
    streamed_content, deltas = stream(fmt, text, cuts)
    assert streamed_content == scan.content == content
    assert calls_from_deltas(deltas) == [(c.name, c.arguments) for c in whole]


@settings(max_examples=100, deadline=None)
@given(args, st.lists(st.integers(0, 10_000), max_size=20))
def test_a_named_functions_output_is_its_arguments(a: dict, cuts: list[int]) -> None:
    text = json.dumps(a)
    whole = whole_calls(scanner("named", "f")(text))
    assert whole is not None and json.loads(whole[0].arguments) == a
    _, deltas = stream("named", text, cuts, "f")
    assert calls_from_deltas(deltas) == [("f", text)]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 10_000), max_size=10))
def test_text_without_calls_is_content_in_pieces_that_add_up(text: str, cuts: list[int]) -> None:
    for fmt in ("hermes", "llama3_json"):
        if fmt == "llama3_json" and text.lstrip().startswith(("{", "<|python_tag|>")):
            continue
        if "<tool_call>" in text:
            continue
        content, deltas = stream(fmt, text, cuts)
        assert deltas == [] and content == text


def test_malformed_or_unfinished_calls_are_content_in_a_whole_answer() -> None:
    for text in [
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": {"a": "\\q"}}</tool_call>',  # bad escape
    ]:
        assert whole_calls(scanner("hermes")(text)) is None


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip
ON = ToolSettings(True, "hermes")


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "server", "param", "message"),
    [
        ({"tools": []}, ON, "tools", "empty"),
        ({"tool_choice": "auto"}, ON, "tool_choice", "`tools` must be set"),
        ({"tools": TOOLS}, ToolSettings(), "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "required"}, ToolSettings(False, "hermes"),
         "tool_choice", "--tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         ON, "tool_choice", "not among the tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, ON,
         "guided_regex", "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
          "response_format": {"type": "json_object"}}, ON, "response_format", "cannot be combined"),
    ],
)  # fmt: skip
def test_tool_choices_the_server_cannot_honour_are_refused_by_name(
    fields: dict, server: ToolSettings, param: str, message: str
) -> None:
    with pytest.raises(APIError) as err:
        plan(chat(**fields), server)
    assert err.value.status == 400 and err.value.param == param
    assert message in err.value.message


def test_tool_choices_become_constraints_and_answers() -> None:
    none, found = plan(chat(tools=TOOLS, tool_choice="none"), ToolSettings())
    assert none.mode is None and found is None and none.tools and len(none.tools) == 2
    auto, found = plan(chat(tools=TOOLS), ON)
    assert auto.mode == "hermes" and found is None
    named, found = plan(chat(tools=TOOLS, tool_choice={"function": {"name": "get_time"}}), ON)
    assert found is not None and found.params.json == {"type": "object", "properties": {}}
    message, finish = whole_message(named, "{}", "stop")
    assert finish == "stop" and message["content"] == ""
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    required, found = plan(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ON)
    assert found is not None and found.params.json["maxItems"] == 1  # type: ignore[index]
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    message, finish = whole_message(required, two, "stop")
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1
    message, finish = whole_message(auto, "Just text.", "stop")
    # No call, no `tool_calls` key (as vLLM and OpenAI answer).
    assert finish == "stop" and message == {"role": "assistant", "content": "Just text."}
