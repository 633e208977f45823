"""KV-cache events in vLLM's wire format: what an engine publishes as its prefix cache changes
and what the router reads to know which blocks each replica holds. One owner for both ends.

The transport is vLLM's (`vllm.distributed.kv_events.ZmqEventPublisher`): a ZeroMQ PUB socket
sends each batch as three frames, (topic, 8-byte big-endian sequence number, msgpack
payload); an optional ROUTER socket replays the batches still buffered from a sequence number
a subscriber sends (8 bytes, big-endian), each as (topic, seq, payload), then an end marker
whose sequence frame is -1. The payload is a `KVEventBatch` encoded as vLLM encodes it: the
batch as an array `[ts, events, data_parallel_rank]`, each event a map tagged by its class name
(`{"type": "BlockStored", ...}`), fields left at their defaults omitted. So vLLM's own decoder
classes read an engine's batches, and this module reads a vLLM replica's.

The settings are vLLM's `--kv-events-config` JSON, with its keys and defaults.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetllm.api.manifests import format_validation_error

MEDIUM_GPU = "GPU"
"""vLLM's name for the tier the engine computes on (its KV pool); other media (CPU, STORAGE)
are offload tiers."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""

BlockKey = bytes | int
"""A block hash as events carry it: bytes (a digest), or vLLM's default, the digest's low 64
bits as an integer."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (`type`) is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence entered the prefix cache: `block_hashes[i]`
    holds `token_ids[i * block_size : (i + 1) * block_size]`, and the first one's parent is
    `parent_block_hash` (None: the first block of a sequence)."""

    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """vLLM's per-block extra hash keys (adapter, cache salt, ...), untagged; None: none."""


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockKey]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    """Reads a batch, vLLM's or ours; fields it does not know are skipped (vLLM adds some from
    release to release)."""
    return msgspec.msgpack.Decoder(KVEventBatch)


class KVEventsConfig(BaseModel):
    """vLLM's `--kv-events-config`: its keys, defaults and refusal of unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1, le=1_000_000)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1, le=1_000_000)
    topic: str = ""

    @model_validator(mode="after")
    def _endpoints(self) -> KVEventsConfig:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a tcp://, ipc:// or inproc:// address")
        return self

    @property
    def enabled(self) -> bool:
        """Whether events are published: vLLM's rule (no publisher named means zmq once
        events are enabled)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The flag's JSON; ValueError naming what is wrong."""
    try:
        data: Any = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    try:
        return KVEventsConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"--kv-events-config: {format_validation_error(exc)}") from None
