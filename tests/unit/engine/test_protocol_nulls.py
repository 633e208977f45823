"""`null` for an optional field means its default, as in OpenAI's schema and vLLM; a required
field given null is still refused with a 400 naming it, and the served schema says so."""

from __future__ import annotations

import json
from typing import Any

import pytest
from engine_requests import ENDPOINTS
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fleetllm.engine.protocol import CompletionRequest, parse_request
from fleetllm.errors import APIError

MINIMAL: dict[type[BaseModel], dict[str, Any]] = dict(ENDPOINTS.values())


def optional_fields(model: type[BaseModel]) -> list[str]:
    return sorted(name for name, f in model.model_fields.items() if not f.is_required())


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda m: m.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_null_optional_fields_parse_as_omitted(model: type[BaseModel], data: st.DataObject) -> None:
    nulls = data.draw(st.lists(st.sampled_from(optional_fields(model)), unique=True, min_size=1))
    body = {**MINIMAL[model], **dict.fromkeys(nulls)}
    omitted = {k: v for k, v in MINIMAL[model].items() if k not in nulls}
    assert parse_request(model, json.dumps(body).encode()) == parse_request(
        model, json.dumps(omitted).encode()
    )


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda m: m.__name__)
def test_null_required_fields_are_refused_by_name(model: type[BaseModel]) -> None:
    for name, field in model.model_fields.items():
        if field.is_required():
            with pytest.raises(APIError) as err:
                parse_request(model, json.dumps({**MINIMAL[model], name: None}).encode())
            assert err.value.param == name


def test_the_usual_nulls_of_openai_clients() -> None:
    body = {"model": "m", "prompt": "hi", "stream": None, "n": None, "logprobs": None}
    body |= {"ignore_eos": None, "echo": None, "max_tokens": None, "stream_options": None}
    parsed = parse_request(CompletionRequest, json.dumps(body).encode())
    assert (parsed.stream, parsed.n, parsed.echo, parsed.ignore_eos) == (False, 1, False, False)


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda m: m.__name__)
def test_the_schema_says_optional_fields_take_null(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    for name in optional_fields(model):
        assert {"type": "null"} in schema["properties"][name]["anyOf"], name
