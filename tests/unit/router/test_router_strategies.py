"""Replica choice: bounded-load consistent hashing, least load, round robin, sessions."""

from __future__ import annotations

import collections
import math
import os
import random
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.router.strategies import (
    Candidate,
    HashRing,
    bounded_prefix,
    least_load,
    load_capacity,
    prefix_text,
    rendezvous,
    round_robin,
    stable_hash,
)

replica_ids = st.lists(
    st.from_regex(r"http://10\.0\.[0-9]{1,2}\.[0-9]{1,3}:8000", fullmatch=True),
    min_size=1,
    max_size=8,
    unique=True,
)


@st.composite
def fleets(draw: st.DrawFn) -> list[Candidate]:
    ids = draw(replica_ids)
    loads = draw(st.lists(st.integers(0, 50), min_size=len(ids), max_size=len(ids)))
    return [Candidate(rid, load) for rid, load in zip(ids, loads, strict=True)]


@given(fleets(), st.integers(0, 2**64 - 1), st.floats(1.0, 3.0))
def test_the_choice_never_exceeds_the_load_bound(
    candidates: list[Candidate], key: int, load_factor: float
) -> None:
    ring = HashRing([c.id for c in candidates])
    order = bounded_prefix(ring, key, candidates, load_factor)
    assert sorted(c.id for c in order) == sorted(c.id for c in candidates)
    total = sum(c.in_flight for c in candidates)
    capacity = load_capacity(total, len(candidates), load_factor)
    chosen = order[0]
    # After placing the request, the chosen replica is within load_factor x the new mean.
    assert chosen.in_flight + 1 <= capacity
    assert capacity == math.ceil(load_factor * (total + 1) / len(candidates))


@given(fleets(), st.integers(0, 2**64 - 1), st.randoms(use_true_random=False))
def test_the_choice_does_not_depend_on_the_order_replicas_are_listed(
    candidates: list[Candidate], key: int, rnd: random.Random
) -> None:
    shuffled = list(candidates)
    rnd.shuffle(shuffled)
    a = bounded_prefix(HashRing([c.id for c in candidates]), key, candidates, 1.25)
    b = bounded_prefix(HashRing([c.id for c in shuffled]), key, shuffled, 1.25)
    assert [c.id for c in a] == [c.id for c in b]


@given(replica_ids, st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=30))
def test_removing_a_replica_moves_only_its_own_keys(ids: list[str], keys: list[str]) -> None:
    before = [Candidate(rid) for rid in ids]
    ring = HashRing(ids)
    placed = {k: bounded_prefix(ring, stable_hash(k), before, 1.25)[0].id for k in keys}
    gone = ids[0]
    after = [c for c in before if c.id != gone]
    if not after:
        return
    smaller = HashRing([c.id for c in after])
    for k in keys:
        now = bounded_prefix(smaller, stable_hash(k), after, 1.25)[0].id
        if placed[k] != gone:
            assert now == placed[k]


def test_with_no_load_a_key_stays_on_its_replica_and_keys_spread() -> None:
    ids = [f"http://10.0.0.{i}:8000" for i in range(4)]
    ring = HashRing(ids)
    candidates = [Candidate(rid) for rid in ids]
    homes = {bounded_prefix(ring, stable_hash("k0"), candidates, 1.25)[0].id for _ in range(5)}
    assert homes == {ring.walk(stable_hash("k0"))[0]}
    spread = collections.Counter(
        bounded_prefix(ring, stable_hash(f"key-{i}"), candidates, 1.25)[0].id for i in range(400)
    )
    assert set(spread) == set(ids)
    # 100 virtual nodes per replica keep the split within a factor of two of even.
    assert max(spread.values()) < 2 * 100 and min(spread.values()) > 100 / 2


def test_an_overloaded_home_replica_sends_the_key_to_the_next_one() -> None:
    ids = [f"http://10.0.0.{i}:8000" for i in range(3)]
    ring = HashRing(ids)
    key = stable_hash("a shared system prompt")
    home = ring.walk(key)[0]
    loads = {rid: 0 for rid in ids}
    loads[home] = 10
    candidates = [Candidate(rid, loads[rid]) for rid in ids]
    order = bounded_prefix(ring, key, candidates, 1.25)
    # mean after placement = 11/3; capacity = ceil(1.25 * 11/3) = 5 < 11
    assert order[0].id == ring.walk(key)[1]
    assert order[-1].id == home


def test_stable_hash_is_the_same_in_another_process() -> None:
    code = (
        "from fleetllm.router.strategies import HashRing, stable_hash;"
        "r = HashRing(['http://a:1', 'http://b:1', 'http://c:1']);"
        "print(stable_hash('prompt'), r.walk(stable_hash('prompt')))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    here = HashRing(["http://a:1", "http://b:1", "http://c:1"])
    assert outputs.pop().strip() == f"{stable_hash('prompt')} {here.walk(stable_hash('prompt'))}"


def test_least_load_prefers_the_lowest_score_and_rotates_ties() -> None:
    a, b, c = Candidate("a", 3), Candidate("b", 0, waiting=1), Candidate("c", 0, kv_usage=0.1)
    assert [x.id for x in least_load([a, b, c])] == ["c", "b", "a"]
    idle = [Candidate("a"), Candidate("b"), Candidate("c")]
    firsts = [least_load(idle, turn)[0].id for turn in range(3)]
    assert firsts == ["a", "b", "c"]


def test_round_robin_rotates() -> None:
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [c.id for c in round_robin(cands, 4)] == ["b", "c", "a"]
    assert round_robin([], 3) == []


@settings(max_examples=50)
@given(replica_ids, st.text(min_size=1, max_size=20))
def test_sessions_stick_and_only_a_removed_replicas_sessions_move(
    ids: list[str], session: str
) -> None:
    cands = [Candidate(rid) for rid in ids]
    home = rendezvous(cands, session)[0].id
    assert rendezvous(list(reversed(cands)), session)[0].id == home
    extra = [*cands, Candidate("http://10.9.9.9:8000")]
    moved = rendezvous(extra, session)[0].id
    assert moved in (home, "http://10.9.9.9:8000")


SYSTEM = "You are a meticulous assistant for a shipping company. " * 8


def test_chat_prefix_renders_messages_in_order_and_is_shared_by_a_system_prompt() -> None:
    one = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}]}
    two = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}]}
    assert prefix_text(one, 256) == prefix_text(two, 256)
    assert prefix_text(one, 256).startswith("system: You are")
    assert len(prefix_text(one, 256)) == 256
    short = {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "x"}]}
    assert prefix_text(short, 256) == "system: hi\nuser: x\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]}
    assert prefix_text(parts, 100) == "user: ab\n"


def test_completion_prefix_from_text_lists_and_token_ids() -> None:
    assert prefix_text({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_text({"prompt": ["first", "second"]}, 100) == "first"
    assert prefix_text({"prompt": [1, 2, 3]}, 100) == "1 2 3"
    assert prefix_text({"prompt": [[7, 8], [9]]}, 100) == "7 8"
    assert prefix_text({"prompt": 5}, 100) == ""
    assert prefix_text({"messages": "not a list", "prompt": None}, 100) == ""


def test_anthropic_and_responses_prompts_share_the_chat_prefix_of_their_system_prompt() -> None:
    chat = {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "x"}]}
    anthropic = {"system": "hi", "messages": [{"role": "user", "content": "x"}]}
    blocks = {"system": [{"type": "text", "text": "hi"}], "messages": anthropic["messages"]}
    responses = {"instructions": "hi", "input": [{"role": "user", "content": "x"}]}
    expected = prefix_text(chat, 100)
    assert [prefix_text(p, 100) for p in (anthropic, blocks, responses)] == [expected] * 3
    long_system = {"system": SYSTEM, "messages": [{"role": "user", "content": "x"}]}
    assert prefix_text(long_system, 64) == f"system: {SYSTEM}"[:64]


def test_embedding_responses_and_rerank_inputs_give_their_prefix() -> None:
    assert prefix_text({"input": "abcdef"}, 4) == "abcd"
    assert prefix_text({"input": ["first", "second"]}, 100) == "first"
    assert prefix_text({"input": [[3, 4], [5]]}, 100) == "3 4"
    assert prefix_text({"query": "what ships", "documents": ["a"]}, 100) == "what ships"
    assert prefix_text({"input": {"odd": 1}}, 100) == ""


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=30),
       st.sampled_from(["messages", "input", "prompt", "query", "system", "instructions"]),
       st.integers(min_value=1, max_value=64))  # fmt: skip
def test_prefix_text_takes_any_json_without_raising_and_within_its_limit(
    value: object, field: str, limit: int
) -> None:
    text = prefix_text({field: value, "messages": value} if field == "system" else {field: value},
                       limit)  # fmt: skip
    assert isinstance(text, str) and len(text) <= limit
