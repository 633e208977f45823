"""Replica choice, as pure functions: each strategy orders a model's candidate replicas, best
first; the proxy tries them in that order (the rest of the order is the failover path).

Everything that must agree between router replicas (the prefix ring, the session mapping)
hashes with blake2b over stable replica ids, never Python's per-process `hash`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A full KV cache weighs as much as this many queued requests in the least-load score.
KV_WEIGHT = 4.0
VIRTUAL_NODES = 100


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a strategy may know of a replica."""

    id: str
    in_flight: int = 0
    """Requests this router has open on the replica."""
    waiting: float = 0.0
    """The engine's queue (vllm:num_requests_waiting), as last scraped."""
    kv_usage: float = 0.0
    """vllm:kv_cache_usage_perc (0..1), as last scraped."""


def stable_hash(data: str | bytes) -> int:
    """A 64-bit hash that is the same in every process and on every machine."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def least_load_score(c: Candidate) -> float:
    return c.in_flight + c.waiting + KV_WEIGHT * c.kv_usage


def least_load(candidates: Sequence[Candidate], turn: int = 0) -> list[Candidate]:
    """Lowest score first; equal scores rotate with `turn` so that an idle fleet is not served
    by its first replica alone."""
    n = len(candidates)
    order = sorted(range(n), key=lambda i: (least_load_score(candidates[i]), (i - turn) % n))
    return [candidates[i] for i in order]


def round_robin(candidates: Sequence[Candidate], turn: int) -> list[Candidate]:
    if not candidates:
        return []
    start = turn % len(candidates)
    return [*candidates[start:], *candidates[:start]]


def rendezvous(candidates: Sequence[Candidate], key: str) -> list[Candidate]:
    """Highest-random-weight order for `key`: a key keeps its replica while that replica
    exists, and only the keys of a removed replica move."""
    return sorted(candidates, key=lambda c: stable_hash(f"{key}\x00{c.id}"), reverse=True)


class HashRing:
    """A consistent-hash ring with virtual nodes over a set of replica ids."""

    def __init__(self, ids: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.ids = frozenset(ids)
        points = sorted(
            (stable_hash(f"{rid}#{i}"), rid) for rid in self.ids for i in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key: int) -> list[str]:
        """Distinct replica ids met going clockwise from `key`."""
        if not self._owners:
            return []
        start = bisect.bisect_left(self._hashes, key)
        seen: dict[str, None] = {}
        total = len(self._owners)
        for step in range(total):
            seen.setdefault(self._owners[(start + step) % total], None)
            if len(seen) == len(self.ids):
                break
        return list(seen)


def load_capacity(total_load: int, replicas: int, load_factor: float) -> int:
    """Most requests one replica may hold once the next request is placed: load_factor x the
    mean load after placement, rounded up (consistent hashing with bounded loads)."""
    return math.ceil(load_factor * (total_load + 1) / replicas)


def bounded_prefix(
    ring: HashRing, key: int, candidates: Sequence[Candidate], load_factor: float
) -> list[Candidate]:
    """The ring order from `key`, restricted to `candidates`, where replicas that are at
    capacity move behind the ones that are not. The first one is the choice: the replica the
    key hashes to unless that would push it past load_factor x mean."""
    by_id = {c.id: c for c in candidates}
    ordered = [by_id[rid] for rid in ring.walk(key) if rid in by_id]
    # Candidates the ring does not know (it is rebuilt lazily) go last, in a stable order.
    known = {c.id for c in ordered}
    ordered += sorted((c for c in candidates if c.id not in known), key=lambda c: c.id)
    if not ordered:
        return []
    capacity = load_capacity(sum(c.in_flight for c in ordered), len(ordered), load_factor)
    fits = [c for c in ordered if c.in_flight + 1 <= capacity]
    return fits + [c for c in ordered if c.in_flight + 1 > capacity]


def most_cached(
    ordered: Sequence[Candidate], cached: Mapping[str, int], tokens: int, load_factor: float
) -> list[Candidate]:
    """kv-aware: the replicas under the load bound first (as `bounded_prefix` bounds them),
    each group by the prompt tokens it holds that count, ties in the given order (the ring's
    from the prompt's first block nobody holds, so that requests for one new prompt meet on
    one replica).

    What every candidate holds counts for none. What one holds beyond that counts only when
    it is at least what the request would add there (`tokens` in all): the request mostly
    continues what that replica holds (a conversation's next turn, another conversation on
    a system prompt it keeps). A request that mostly starts something new (a new system
    prompt after a preamble every replica holds, and a block of it that one replica happens
    to hold) is placed by its own new blocks instead, so that new prompts spread over the
    replicas rather than pile onto the one that holds the most of what they share."""
    if not ordered:
        return []
    capacity = load_capacity(sum(c.in_flight for c in ordered), len(ordered), load_factor)
    common = min(cached.get(c.id, 0) for c in ordered)

    def counted(c: Candidate) -> int:
        held = cached.get(c.id, 0)
        return held if held - common >= tokens - held else common

    return sorted(ordered, key=lambda c: (c.in_flight + 1 > capacity, -counted(c)))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return ""


def prefix_text(payload: Mapping[str, Any], limit: int) -> str:
    """The first `limit` characters of the prompt as the engine will see it: for chat, the
    messages in order as `role: content` lines (after Anthropic's `system` or the Responses
    API's `instructions`), so that requests sharing a system prompt share a prefix; else the
    first prompt (`prompt`, or `input` of embeddings and Responses, or a rerank's `query`).
    Unknown shapes give "" (and hash to one spot: they are invalid anyway)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) and _is_messages(payload.get("input")):
        messages = payload["input"]
    if isinstance(messages, list):
        head = payload.get("system") or payload.get("instructions")
        out = [f"system: {_content_text(head)}\n"] if head else []
        size = sum(len(line) for line in out)
        for message in messages:
            if size >= limit:
                break
            if not isinstance(message, dict):
                continue
            line = f"{message.get('role', '')}: {_content_text(message.get('content'))}\n"
            out.append(line)
            size += len(line)
        return "".join(out)[:limit]
    prompt = next(
        (payload[k] for k in ("prompt", "input", "query") if payload.get(k) is not None), None
    )
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            prompt = " ".join(str(t) for t in prompt[: limit // 2])
        elif isinstance(first, list):
            prompt = " ".join(str(t) for t in first[: limit // 2])
        else:
            prompt = first
    return prompt[:limit] if isinstance(prompt, str) else ""


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)
