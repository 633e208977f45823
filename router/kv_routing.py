"""The `kv-aware` strategy's state for one model: its replicas' KV-event feeds, the index they
keep, the model's tokenizer, and the prediction for one request: how many of its prompt tokens
each replica holds in its prefix cache.

A prediction needs the request's tokens (a tokenizer for the model, a request shape the
router can reproduce: `prompt_tokens`) and a fresh view of every candidate (`kv_feed`);
without either, `predict` gives None and the pool routes by today's prefix hash instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.asyncio

from fleetllm.kv_events import BlockKey
from fleetllm.router.block_keys import VllmHasher, request_keys
from fleetllm.router.discovery import KVEventsEndpoint
from fleetllm.router.kv_feed import FeedSettings, KVFeed, cancel
from fleetllm.router.kv_index import BatchSequencer, Layout, PrefixIndex
from fleetllm.router.prompt_tokens import PromptTokenizer

log = logging.getLogger("fleetllm.router")


@dataclass
class _Feed:
    endpoint: KVEventsEndpoint
    feed: KVFeed
    task: asyncio.Task[None]


class KVRouting:
    """Created for a model routed `kv-aware`; `update` follows its replicas."""

    def __init__(
        self,
        model: str,
        max_blocks_per_replica: int,
        max_prompt_tokens: int,
        feed_settings: FeedSettings,
        on_resync: Callable[[str, str], None] = lambda replica, reason: None,
    ) -> None:
        self.model = model
        self.index = PrefixIndex(max_blocks_per_replica)
        self.max_prompt_tokens = max_prompt_tokens
        self.feed_settings = feed_settings
        self.on_resync = on_resync
        self.vllm = VllmHasher()
        self.prompts: PromptTokenizer | None = None
        self._tokenizer_dir: str | None = None
        self._loading: asyncio.Task[None] | None = None
        self._feeds: dict[str, _Feed] = {}

    def update(
        self,
        context: zmq.asyncio.Context,
        endpoints: Mapping[str, KVEventsEndpoint | None],
        tokenizer_dir: str | None,
    ) -> None:
        """Follow the replicas' event endpoints (replica id -> endpoint) and the model's
        tokenizer directory; call on the event loop."""
        for replica_id in list(self._feeds):
            if endpoints.get(replica_id) != self._feeds[replica_id].endpoint:
                self._stop_feed(replica_id)
        for replica_id, endpoint in endpoints.items():
            if endpoint is not None and replica_id not in self._feeds:
                self._start_feed(context, replica_id, endpoint)
        if tokenizer_dir != self._tokenizer_dir:
            self._tokenizer_dir = tokenizer_dir
            self.prompts = None
            if self._loading is not None:
                self._loading.cancel()
            self._loading = (
                asyncio.create_task(self._load_tokenizer(tokenizer_dir)) if tokenizer_dir else None
            )

    async def stop(self) -> None:
        tasks = [self._stop_feed(replica_id) for replica_id in list(self._feeds)]
        for task in [*tasks, self._loading]:
            await cancel(task)

    def _start_feed(
        self, context: zmq.asyncio.Context, replica_id: str, endpoint: KVEventsEndpoint
    ) -> None:
        sequencer = BatchSequencer(
            self.index.replica(replica_id),
            self.vllm,
            on_lost=lambda reason: self.on_resync(replica_id, reason),
        )
        feed = KVFeed(context, endpoint.events, endpoint.replay, sequencer, self.feed_settings)
        self._feeds[replica_id] = _Feed(endpoint, feed, asyncio.create_task(feed.run()))

    def _stop_feed(self, replica_id: str) -> asyncio.Task[None]:
        entry = self._feeds.pop(replica_id)
        entry.task.cancel()
        self.index.forget(replica_id)
        return entry.task

    async def _load_tokenizer(self, directory: str) -> None:
        try:
            self.prompts = await asyncio.to_thread(
                PromptTokenizer.load, Path(directory), self.max_prompt_tokens
            )
        except (OSError, ValueError) as exc:
            log.error(
                "the model's tokenizer cannot be loaded: kv-aware routing falls back to prefix",
                extra={"model": self.model, "error": str(exc)},
            )

    def feed(self, replica_id: str) -> KVFeed | None:
        entry = self._feeds.get(replica_id)
        return entry.feed if entry is not None else None

    def fresh(self, replica_ids: Sequence[str]) -> bool:
        now = time.monotonic()
        return all((f := self.feed(r)) is not None and f.fresh(now) for r in replica_ids)

    def predict(self, payload: Mapping[str, Any], replica_ids: Sequence[str]) -> Prediction | None:
        """What the given replicas hold of the request's prompt; None when the router cannot
        know (no tokenizer, a request it cannot reproduce, a stale view)."""
        if self.prompts is None or not self.fresh(replica_ids):
            return None
        tokens = self.prompts.tokens(payload)
        if tokens is None:
            return None
        salt = payload.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        # The engine computes the last prompt token whatever it holds (its logits are needed).
        usable = tokens[: max(0, len(tokens) - 1)]
        keys = {
            layout: request_keys(layout[0], usable, layout[1], salt, len(usable), self.vllm)
            for layout in self.index.layouts(replica_ids)
        }
        matched = self.index.matched(replica_ids, keys)
        cached = {
            replica_id: blocks * (self.index.replicas[replica_id].block_size or 0)
            for replica_id, blocks in matched.items()
        }
        return Prediction(cached, len(usable), _first_missing_key(keys, matched, self.index))


@dataclass(frozen=True)
class Prediction:
    cached: dict[str, int]
    """Replica id -> prompt tokens the engine will find cached there."""
    tokens: int
    """The prompt tokens a cache can hold (all but the last)."""
    new_block: int | None
    """A 64-bit key of the first block of the prompt that no replica holds; None where the
    replicas hold all of its full blocks (or it has none). Replicas that hold equally much
    are ordered on the ring from this key: requests for one new prompt meet on one replica,
    and new prompts that share their first blocks (a common preamble) still spread, which a
    key from the prompt's first characters cannot do."""


def _first_missing_key(
    keys: Mapping[Layout, Sequence[BlockKey]], matched: Mapping[str, int], index: PrefixIndex
) -> int | None:
    """`Prediction.new_block`: in the first layout (a fleet of one kind has one) whose
    replicas do not hold all of the request's blocks, the first block none of them holds."""
    layouts = {r: blocks.layout for r in matched if (blocks := index.replicas.get(r))}
    for layout in sorted(keys, key=lambda lay: (lay[0].value, lay[1])):
        held = max((n for r, n in matched.items() if layouts.get(r) == layout), default=0)
        if held < len(keys[layout]):
            key = keys[layout][held]
            return key if isinstance(key, int) else int.from_bytes(key[:8], "big")
    return None
