"""Fields outside the request models: vLLM's that the engine does not serve are refused by name
when they ask for something and taken when they ask for nothing; unknown ones are ignored and
logged once per name, never with their value; whatever a client sends there, the answer is
the request or a 400."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from engine_requests import ENDPOINTS
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fleetllm.engine.protocol import parse_request
from fleetllm.engine.request_fields import (
    CHAT,
    COMPLETION,
    MAX_LOGGED_NAMES,
    TOKENIZE_CHAT,
    UNSERVED,
    WITHOUT_EFFECT,
    FieldPolicy,
)
from fleetllm.errors import APIError

# For each unserved field: a value that asks for nothing (vLLM's default, as clients that fill
# every field send it) and one that asks for what the engine does not do.
EXAMPLES: dict[str, tuple[Any, Any]] = {
    "use_beam_search": (False, True),
    "length_penalty": (1.0, 0.5),
    "watermarking": (False, True),
    "spaces_between_special_tokens": (True, False),
    "logprob_token_ids": ([], [3, 4]),
    "priority": (0, 5),
    "return_tokens_as_token_ids": (False, True),
    "return_token_offsets": (False, True),
    "routed_experts_prompt_start": (0, 3),
    "return_prompt_text": (False, True),
    "mm_payload": ("tensors", "json"),
    "return_mm_kwargs": (False, True),
    "kv_transfer_params": ({}, {"do_remote_prefill": True}),
    "ec_transfer_params": ({}, {"x": 1}),
    "vllm_xargs": ({}, {"session_id": "s"}),
    "repetition_detection": ({}, {"max_pattern_size": 4}),
    "stream_interval": (1, 4),
    "thinking_token_budget": (-1, 100),
    "prompt_embeds": ("", "AAAA"),
    "chat_template": (None, "{{ messages }}"),
    "media_io_kwargs": ({}, {"image": {"x": 1}}),
    "mm_processor_kwargs": ({}, {"num_crops": 4}),
}


def request(endpoint: str, **fields: Any) -> BaseModel:
    model, minimal = ENDPOINTS[endpoint]
    return parse_request(model, json.dumps({**minimal, **fields}).encode())


def test_every_unserved_field_has_examples() -> None:
    assert set(EXAMPLES) == set(UNSERVED)


@pytest.mark.parametrize("name", sorted(UNSERVED))
def test_an_unserved_field_is_refused_by_name_only_when_it_asks_for_something(name: str) -> None:
    neutral, asking = EXAMPLES[name]
    for endpoint in sorted(UNSERVED[name].endpoints):
        policy = FieldPolicy()
        for value in (neutral, None):
            policy.check(request(endpoint, **{name: value}), endpoint)
        with pytest.raises(APIError) as err:
            policy.check(request(endpoint, **{name: asking}), endpoint)
        assert err.value.status == 400 and err.value.param == name
        assert err.value.message.startswith(f"{name}: ")
    # A field of vLLM's that an endpoint does not have is unknown there, as in vLLM.
    for endpoint in sorted(set(ENDPOINTS) - UNSERVED[name].endpoints):
        model = ENDPOINTS[endpoint][0]
        if name not in model.model_fields:
            FieldPolicy().check(request(endpoint, **{name: asking}), endpoint)


def test_a_declared_field_is_the_models_to_judge() -> None:
    """Structured outputs and tools are served: the request models declare them, so the
    table never sees them."""
    tool = {"type": "function", "function": {"name": "f"}}
    for endpoint, fields in (
        (COMPLETION, {"structured_outputs": {"regex": "[a-z]+"}}),
        (CHAT, {"tools": [tool], "tool_choice": "auto", "parallel_tool_calls": False}),
        (TOKENIZE_CHAT, {"tools": [tool]}),
    ):
        req = request(endpoint, **fields)
        assert not req.model_extra
        FieldPolicy().check(req, endpoint)


def test_a_template_in_the_kwargs_is_refused_as_the_field_is() -> None:
    kwargs = {"chat_template": "{{ messages }}", "other": 1}
    for endpoint in (CHAT, TOKENIZE_CHAT):
        with pytest.raises(APIError) as err:
            FieldPolicy().check(request(endpoint, chat_template_kwargs=kwargs), endpoint)
        assert err.value.param == "chat_template_kwargs"
        FieldPolicy().check(request(endpoint, chat_template_kwargs={"other": 1}), endpoint)


@pytest.mark.parametrize("name", sorted(WITHOUT_EFFECT))
def test_fields_without_effect_are_taken_silently_but_typed(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind, endpoints = WITHOUT_EFFECT[name]
    good = "s-1" if kind is str else False
    for endpoint in endpoints:
        FieldPolicy().check(request(endpoint, **{name: good}), endpoint)
        FieldPolicy().check(request(endpoint, **{name: None}), endpoint)
        with pytest.raises(APIError) as err:
            FieldPolicy().check(request(endpoint, **{name: 7}), endpoint)
        assert err.value.param == name
    assert caplog.records == []


def test_unknown_fields_are_logged_once_per_name_without_their_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = FieldPolicy()
    caplog.set_level(logging.WARNING, "fleetllm.engine.requests")
    secret = "sk-secret-value-never-logged"
    for endpoint in (CHAT, COMPLETION, CHAT):
        policy.check(request(endpoint, store=secret, metadata={"k": secret}), endpoint)
    records = [r for r in caplog.records if r.getMessage() == "unknown request field ignored"]
    assert sorted(r.field for r in records) == ["metadata", "store"]  # type: ignore[attr-defined]
    assert all(r.levelno == logging.WARNING for r in records)
    assert secret not in caplog.text
    assert all(secret not in str(vars(r)) for r in caplog.records)


def test_unknown_names_are_logged_printable_short_and_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = FieldPolicy()
    caplog.set_level(logging.WARNING, "fleetllm.engine.requests")
    policy.check(request(CHAT, **{"bad\nname\x1b" + "x" * 500: 1}), CHAT)
    (record,) = caplog.records
    assert record.field == "bad?name?" + "x" * 55  # type: ignore[attr-defined]
    caplog.clear()
    for i in range(0, 2 * MAX_LOGGED_NAMES, 50):
        policy.check(request(CHAT, **{f"f{j}": 1 for j in range(i, i + 50)}), CHAT)
    named = [r for r in caplog.records if r.getMessage() == "unknown request field ignored"]
    assert len(named) == MAX_LOGGED_NAMES - 1  # the first name was logged before
    assert [r.getMessage() for r in caplog.records].count(
        "unknown request fields: more names than are logged"
    ) == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
field_names = st.sampled_from(sorted({*UNSERVED, *WITHOUT_EFFECT})) | st.text(
    st.characters(blacklist_categories=("Cs",)), min_size=1
)


@settings(max_examples=300, deadline=None)
@given(
    endpoint=st.sampled_from(sorted(ENDPOINTS)),
    extra=st.dictionaries(field_names, json_values, max_size=6),
)
def test_any_extra_fields_give_the_request_or_a_400_naming_one(
    endpoint: str, extra: dict[str, Any]
) -> None:
    model, minimal = ENDPOINTS[endpoint]
    body = {**extra, **minimal}
    try:
        req = parse_request(model, json.dumps(body).encode())
        FieldPolicy().check(req, endpoint)
    except APIError as exc:
        assert exc.status == 400
        assert exc.param in body or exc.param in model.model_fields
