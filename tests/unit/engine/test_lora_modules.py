"""`--lora-modules` entries as vLLM reads them: `name=path`, or its JSON form; anything else is
a ValueError that quotes the entry (fuzzed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.engine.serving_lora import LoRAModule, parse_lora_module


def test_both_of_vllms_forms() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module("a=b=c") == LoRAModule("a", "b=c")  # split at the first '='
    entry = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}'
    assert parse_lora_module(entry) == LoRAModule("sql", "/adapters/sql", "base")
    assert parse_lora_module('{"name": "x", "path": "/p"}') == LoRAModule("x", "/p")


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("{not json", "invalid JSON"),
        ('["sql", "/p"]', "expected name=path or a JSON object"),
        ('{"name": "x"}', "needs string fields name and path"),
        ('{"name": "x", "path": "/p", "rank": 8}', "unknown fields: ['rank']"),
        ('{"name": "x", "path": "/p", "base_model_name": 3}', "base_model_name must be a string"),
        ('{"name": "x", "path": "/p", "is_3d_lora_weight": true}', "is_3d_lora_weight"),
    ],
)
def test_malformed_entries_are_refused_naming_the_problem(entry: str, words: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules") as caught:
        parse_lora_module(entry)
    assert words in str(caught.value)


@given(st.text(max_size=40))
def test_any_entry_parses_or_is_refused(entry: str) -> None:
    try:
        module = parse_lora_module(entry)
    except ValueError as exc:
        assert str(exc).startswith("--lora-modules")
    else:
        assert isinstance(module.name, str) and isinstance(module.path, str)
