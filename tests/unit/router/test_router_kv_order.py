"""kv-aware's pure parts: the order (most cached first where it counts, within the same load
bound as prefix, ties in the ring's order), the prompt's tokens as the engine sees them, and the
router's reading of what replicas send (any bytes: a view or a counted malformed batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router_strategies import fleets

from fleetllm.engine.model_files import resolve_model
from fleetllm.kv_events import BlockStored, KVEventBatch, decoder, encoder
from fleetllm.router.block_keys import VllmHasher
from fleetllm.router.kv_index import MalformedBatch, ReplicaBlocks, parse_batch
from fleetllm.router.prompt_tokens import PromptTokenizer
from fleetllm.router.strategies import (
    Candidate,
    HashRing,
    bounded_prefix,
    load_capacity,
    most_cached,
)
from fleetllm.tokenizer import Tokenizer


@given(fleets(), st.integers(0, 2**64 - 1), st.floats(1.0, 3.0), st.data())
def test_most_cached_first_within_the_load_bound(
    candidates: list[Candidate], key: int, load_factor: float, data: st.DataObject
) -> None:
    cached = {c.id: data.draw(st.integers(0, 4)) * 16 for c in candidates}
    tokens = data.draw(st.integers(max(cached.values()), 160))
    ring_order = bounded_prefix(HashRing([c.id for c in candidates]), key, candidates, load_factor)
    order = most_cached(ring_order, cached, tokens, load_factor)
    assert sorted(c.id for c in order) == sorted(c.id for c in candidates)
    capacity = load_capacity(sum(c.in_flight for c in candidates), len(candidates), load_factor)
    fits = [c for c in candidates if c.in_flight + 1 <= capacity]
    chosen = order[0]
    # The same bound as prefix: the choice fits whenever any replica does ...
    assert chosen.in_flight + 1 <= capacity
    # ... a replica that fits and holds beyond what all hold at least what the request would
    # add there is never passed over for one that holds less ...
    common = min(cached.values())
    leads = [c for c in fits if cached[c.id] - common >= tokens - cached[c.id]]
    if leads:
        assert cached[chosen.id] == max(cached[c.id] for c in leads)
    # ... and among those that count as much, the ring decides.
    else:
        assert chosen.id == next(c.id for c in ring_order if c in fits)


def test_a_replica_over_the_bound_loses_its_cache_advantage() -> None:
    busy, idle = Candidate("a", in_flight=9), Candidate("b", in_flight=0)
    order = most_cached([busy, idle], {"a": 512, "b": 0}, 600, 1.25)
    assert [c.id for c in order] == ["b", "a"]
    order = most_cached([Candidate("a", 1), idle], {"a": 512, "b": 0}, 600, 1.25)
    assert [c.id for c in order] == ["a", "b"]


def test_a_new_prompt_after_a_shared_preamble_is_placed_by_the_ring() -> None:
    """Every replica holds the preamble (112 tokens) and "a" one block more of it: the new
    prompt (172 tokens) adds far more than that block saves, so the ring places it; the next
    turn of a conversation "a" holds goes to "a"."""
    ring_order = [Candidate("b"), Candidate("a"), Candidate("c")]
    preamble = {"a": 128, "b": 112, "c": 112}
    assert [c.id for c in most_cached(ring_order, preamble, 172, 1.25)] == ["b", "a", "c"]
    conversation = {"a": 352, "b": 112, "c": 112}
    assert most_cached(ring_order, conversation, 385, 1.25)[0].id == "a"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(smollm2: Path) -> PromptTokenizer:
    return PromptTokenizer.load(smollm2, max_tokens=4096)


@pytest.fixture(scope="module")
def engine_tokenizer(smollm2: Path) -> Tokenizer:
    """The engine's own tokenizer, loaded as the engine loads it."""
    return Tokenizer.from_pretrained(smollm2)


def test_the_prompt_is_tokenized_as_the_engine_tokenizes_it(
    prompts: PromptTokenizer, engine_tokenizer: Tokenizer
) -> None:
    tok = engine_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert prompts.tokens({"messages": messages}) == chat
    no_generation = {"messages": messages, "add_generation_prompt": False}
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert prompts.tokens(no_generation) == tok.encode(rendered, add_special_tokens=False)
    assert prompts.tokens({"prompt": "Once upon"}) == tok.encode("Once upon")
    assert prompts.tokens({"prompt": ["Once upon"]}) == tok.encode("Once upon")
    assert prompts.tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    # What the router cannot reproduce gives None; prompt logprobs start from scratch.
    for payload in (
        {"messages": messages, "tools": [{"type": "function"}]},
        {"messages": messages, "continue_final_message": True},
        {"prompt": ["one", "two"]},
        {"prompt": "x", "truncate_prompt_tokens": 4},
        {"messages": "not a list"},
        {},
    ):
        assert prompts.tokens(payload) is None, payload
    assert prompts.tokens({"prompt": "x", "prompt_logprobs": 1}) == []
    assert prompts.tokens({"prompt": "x", "echo": True, "logprobs": 1}) == []


def test_a_huge_prompt_costs_its_beginning(prompts: PromptTokenizer) -> None:
    tokens = prompts.tokens({"prompt": "harbor lantern " * 200_000})
    assert tokens is not None and len(tokens) == prompts.max_tokens


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "messages": json_values,
            "prompt": json_values,
            "chat_template_kwargs": json_values,
            "add_generation_prompt": json_values,
            "add_special_tokens": json_values,
            "echo": json_values,
            "logprobs": json_values,
        },
    )
)
def test_any_payload_gives_tokens_or_none(
    prompts: PromptTokenizer, payload: dict[str, Any]
) -> None:
    tokens = prompts.tokens(payload)
    assert tokens is None or (
        len(tokens) <= prompts.max_tokens and all(isinstance(t, int) for t in tokens)
    )


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
keys = st.binary(min_size=30, max_size=34) | st.integers(-(2**63), 2**64 - 1)
token_ids = st.lists(st.integers(0, 50) | st.integers(-(2**63), 2**64 - 1), min_size=0, max_size=40)
stored = st.fixed_dictionaries(
    {
        "type": st.just("BlockStored"),
        "block_hashes": st.lists(keys, max_size=4),
        "parent_block_hash": st.none() | keys,
        "token_ids": token_ids,
        "block_size": st.integers(-2, 20),
        "lora_id": st.none() | st.integers(0, 3),
        "medium": st.sampled_from(["GPU", "CPU", None]),
        "lora_name": st.none() | st.text(max_size=5),
    },
    optional={"extra_keys": st.none() | st.lists(st.none() | st.tuples(st.text(max_size=4)))},
)
removed = st.fixed_dictionaries(
    {
        "type": st.just("BlockRemoved"),
        "block_hashes": st.lists(keys, max_size=4),
        "medium": st.sampled_from(["GPU", "CPU", None]),
    }
)
events = (
    stored
    | removed
    | st.just({"type": "AllBlocksCleared"})
    | st.dictionaries(st.sampled_from(["type", "block_hashes", "medium"]), msgpack_values)
)


def _applied(payload: bytes) -> ReplicaBlocks | None:
    """A replica's blocks of 8 after the batch `payload`; None when it is refused."""
    try:
        batch = parse_batch(payload, decoder())
    except MalformedBatch:
        return None
    blocks = ReplicaBlocks(max_blocks=8)
    blocks.apply(batch, VllmHasher())
    return blocks


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        msgpack_values.map(msgspec.msgpack.encode),
        st.tuples(msgpack_values, st.lists(events, max_size=3), msgpack_values).map(
            lambda t: msgspec.msgpack.encode(list(t))
        ),
    )
)
def test_any_bytes_from_a_replica_are_a_batch_or_refused(payload: bytes) -> None:
    blocks = _applied(payload)
    # A batch that reads is applied without error, whatever it holds.
    assert blocks is None or len(blocks.keys) <= 8


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        BlockStored,
        block_hashes=st.lists(st.binary(min_size=32, max_size=32) | st.integers(0, 2**64 - 1)),
        parent_block_hash=st.none() | st.binary(min_size=32, max_size=32),
        token_ids=st.lists(st.integers(-(2**63), 2**64 - 1), max_size=24),
        block_size=st.integers(1, 8),
        lora_id=st.none(),
        medium=st.sampled_from(["GPU", None]),
        lora_name=st.none(),
    )
)
def test_a_well_formed_event_with_any_values_is_applied_or_refused(event: BlockStored) -> None:
    payload = encoder().encode(KVEventBatch(0.0, [event]))
    blocks = _applied(payload)
    # Applied within its bound, one key per block the event names, never more.
    assert blocks is None or len(blocks.keys) <= min(8, len(event.block_hashes))


chat_text = st.lists(
    st.text(max_size=30)
    | st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "  \n", "1234", " <|im_"]),
    max_size=6,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": chat_text}
        ),
        min_size=1,
        max_size=5,
    )
)
def test_a_chat_tokenized_piece_by_piece_is_the_engines_tokens(
    prompts: PromptTokenizer, engine_tokenizer: Tokenizer, messages: list[dict[str, str]]
) -> None:
    tok = engine_tokenizer
    expected = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    # Twice: the second time from the piece cache.
    assert prompts.tokens({"messages": messages}) == expected
    assert prompts.tokens({"messages": messages}) == expected
