"""The context length the router reads from a replica's model card: only a positive integer
within reason, of the served name's card, is believed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.router.model_card import MAX_CONTEXT, max_model_len_of


def card(model: str, value: Any) -> dict[str, Any]:
    return {"id": model, "object": "model", "max_model_len": value}


def test_the_served_names_card_gives_the_length() -> None:
    doc = {"object": "list", "data": [card("lora-a", 512), card("m", 4096)]}
    assert max_model_len_of(doc, "m") == 4096
    assert max_model_len_of(doc, "lora-a") == 512
    assert max_model_len_of(doc, "other") is None


@pytest.mark.parametrize(
    "value", [None, 0, -1, True, 1.5, "4096", MAX_CONTEXT + 1, [4096], {"n": 1}]
)
def test_a_value_that_is_not_a_plausible_length_is_not_believed(value: Any) -> None:
    assert max_model_len_of({"data": [card("m", value)]}, "m") is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=25,
)


@given(json_values, json_values)
def test_any_answer_gives_a_plausible_length_or_none(doc: Any, value: Any) -> None:
    for candidate in (doc, {"data": doc}, {"data": [card("m", value), doc]}):
        found = max_model_len_of(json.loads(json.dumps(candidate, allow_nan=True)), "m")
        assert found is None or (type(found) is int and 0 < found <= MAX_CONTEXT)
