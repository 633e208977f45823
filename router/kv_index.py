"""What each replica's KV cache holds, as its events tell (pure; `kv_feed` does the I/O).

`ReplicaBlocks` is one replica's view: the block keys it holds, its block size, whether its
keys are the ones the router computes (checked on every unsalted first block it stores), and
how much of its history the view covers. `BatchSequencer` orders one replica's batches by
their sequence numbers: it applies each batch once and in order, and says when the view must
be rebuilt from the replica's replay buffer (a gap, a publisher that restarted, a batch
dropped by the publisher). `PrefixIndex` holds one model's views and answers, for a request's
keys, how many leading blocks each replica holds.

The view is never ahead of the replica: a key is in it only if a BlockStored for it came and
no BlockRemoved or clear followed. When history is lost (a gap no replay fills), the view is
cleared and rebuilt from what still arrives, so it may miss blocks the replica holds, but it
never claims one the replica lost.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from fleetllm.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
)
from fleetllm.router.block_keys import Scheme, VllmHasher, first_block_matches, scheme_of

Layout = tuple[Scheme, int]
"""How a replica's keys are made: the scheme and the block size."""
MAX_KEY_BYTES = 64
"""Longer byte keys are no hash any engine makes: such an event is malformed."""
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = 1 << 31
_RECENT = 1024
"""Digests of the last batches applied, to tell a batch seen twice from a restarted
publisher's batch of the same number."""


class MalformedBatch(ValueError):
    """A batch that is not vLLM's format or holds values no engine sends."""


def parse_batch(payload: bytes, decode: msgspec.msgpack.Decoder[KVEventBatch]) -> KVEventBatch:
    try:
        batch = decode.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBatch(str(exc)) from None
    for event in batch.events:
        if isinstance(event, BlockStored):
            keys = [*event.block_hashes, event.parent_block_hash]
            if not 1 <= event.block_size <= MAX_BLOCK_SIZE:
                raise MalformedBatch(f"block_size {event.block_size} is out of range")
            tokens = event.token_ids
            if tokens and not (min(tokens) >= 0 and max(tokens) < MAX_TOKEN_ID):
                raise MalformedBatch("a token id is out of range")
        elif isinstance(event, BlockRemoved):
            keys = event.block_hashes
        else:
            continue
        if any(isinstance(k, bytes) and len(k) > MAX_KEY_BYTES for k in keys):
            raise MalformedBatch("a block hash is longer than any engine's")
    return batch


@dataclass
class ReplicaBlocks:
    """One replica's cached blocks, bounded: past `max_blocks`, the oldest stored are
    forgotten (the view then misses blocks, never invents them)."""

    max_blocks: int
    keys: OrderedDict[BlockKey, None] = field(default_factory=OrderedDict)
    block_size: int | None = None
    scheme: Scheme | None = None
    mismatch: str | None = None
    """Why this replica's keys cannot be trusted (they are not what the router computes)."""

    @property
    def layout(self) -> Layout | None:
        """How to compute keys this replica's view can be asked about; None: not yet known."""
        if self.scheme is None or self.block_size is None:
            return None
        return (self.scheme, self.block_size)

    def clear(self) -> None:
        self.keys.clear()

    def apply(self, batch: KVEventBatch, vllm: VllmHasher) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium not in (None, MEDIUM_GPU):
                    continue  # an offload tier's copy; requests are served from the pool
                self._check(event, vllm)
                self.block_size = event.block_size
                for key in event.block_hashes:
                    self.keys[key] = None
                    self.keys.move_to_end(key)
                while len(self.keys) > self.max_blocks:
                    self.keys.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                if event.medium not in (None, MEDIUM_GPU):
                    continue
                for key in event.block_hashes:
                    self.keys.pop(key, None)
            elif isinstance(event, AllBlocksCleared):
                self.keys.clear()

    def _check(self, event: BlockStored, vllm: VllmHasher) -> None:
        """Learn the replica's scheme from its keys, and check it on unsalted first blocks:
        a replica hashing otherwise (another algorithm or seed) is not trusted."""
        if not event.block_hashes or self.mismatch is not None:
            return
        scheme = scheme_of(event.block_hashes[0])
        if scheme is None:
            self.mismatch = "its block hashes are neither fleetllm's nor vLLM's"
            return
        if self.scheme is not None and scheme is not self.scheme:
            self.mismatch = "its block hashes changed kind"
            return
        self.scheme = scheme
        unsalted = not event.extra_keys or event.extra_keys[0] is None
        if event.parent_block_hash is None and unsalted and event.lora_name is None:
            first = event.token_ids[: event.block_size]
            if not first_block_matches(event.block_hashes[0], first, event.block_size, vllm):
                self.mismatch = (
                    f"its first-block hashes are not {scheme.value}'s as the router computes "
                    "them (another hash algorithm or seed)"
                )

    def matched(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the replica holds."""
        held = self.keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count


@dataclass
class Resync:
    """The view must be rebuilt: replay the replica's buffer from `start`."""

    start: int
    reason: str


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


class BatchSequencer:
    """Applies one replica's batches in sequence order, each once.

    Live batches (`on_live`) must follow the last one applied; anything else asks for a
    replay. A replay after a gap starts at the last batch applied (`anchor`); the periodic
    check starts at the last batch a check confirmed (`check_start`), so that it also sees a
    publisher that restarted and lost its first batch (vLLM's numbering names no publisher:
    the new one's later batches may follow the old one's numbers). An answer whose batches
    are, wherever the view has applied the same number, the very same bytes (timestamps
    included) continues the view. Any other answer means the publisher restarted (or its
    buffer moved past the view): the view is rebuilt from the whole buffer. A hole inside an
    answer (a batch the publisher dropped) clears the view, which goes on from the batch after
    the hole. Each loss of history is reported to `on_lost` with its reason.
    """

    def __init__(
        self,
        blocks: ReplicaBlocks,
        vllm: VllmHasher,
        on_lost: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.blocks = blocks
        self.vllm = vllm
        self.on_lost = on_lost
        self._decode = decoder()
        self.next_seq: int | None = None
        """The number the next live batch must have; None until the first replay."""
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self._checked: int | None = None
        """The last batch a replay confirmed; None: none since the view (re)started."""
        self.malformed = 0

    @property
    def anchor(self) -> int:
        """Where a replay after a gap starts: the last batch applied (to check it), else 0."""
        return max(0, (self.next_seq or 0) - 1)

    @property
    def check_start(self) -> int:
        """Where the periodic check's replay starts: the last batch a check confirmed, while
        the view still knows it (else the last applied)."""
        if self._checked is not None and self._checked in self._recent:
            return self._checked
        return self.anchor

    def on_live(self, seq: int, payload: bytes) -> Resync | None:
        if self.next_seq is None:
            return Resync(0, "first sync")
        if seq == self.next_seq:
            self._apply(seq, payload)
            return None
        if seq < self.next_seq and self._recent.get(seq) == digest(payload):
            return None  # already applied (it came in a replay too)
        if seq > self.next_seq:
            return Resync(self.anchor, "gap")
        return Resync(0, "publisher restarted")

    def on_replay(self, start: int, batches: Sequence[tuple[int, bytes]]) -> Resync | None:
        """Apply the answer to a replay from `start`; a further replay to ask for, if the
        answer shows the view must be rebuilt from the buffer's beginning."""
        if self.next_seq:
            first = batches[0] if batches else None
            if (
                first is not None
                and first[0] == start
                and start in self._recent
                and all(
                    self._recent[seq] == digest(payload)
                    for seq, payload in batches
                    if seq in self._recent
                )
            ):
                batches = [(seq, payload) for seq, payload in batches if seq >= self.next_seq]
            else:
                self._restart()
                self.on_lost("publisher restarted")
                if start > 0:
                    return Resync(0, "publisher restarted")
        if self.next_seq is None:
            self.next_seq = batches[0][0] if batches else 0
            if self.next_seq:
                self.on_lost("history older than the replay buffer")
        for seq, payload in batches:
            if seq != self.next_seq:
                self.on_lost("batches dropped by the publisher")
                self.blocks.clear()
            self._apply(seq, payload)
        self._checked = self.anchor
        return None

    def _restart(self) -> None:
        self.blocks.clear()
        self.blocks.scheme = None
        self.blocks.mismatch = None
        self.next_seq = None
        self._recent.clear()
        self._checked = None

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self._recent[seq] = digest(payload)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        try:
            batch = parse_batch(payload, self._decode)
        except MalformedBatch:
            # What it said is unknown: the view restarts from the batches after it.
            self.malformed += 1
            self.on_lost("malformed batch")
            self.blocks.clear()
            return
        self.blocks.apply(batch, self.vllm)


class PrefixIndex:
    """One model's replicas' views."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self.replicas: dict[str, ReplicaBlocks] = {}

    def replica(self, replica_id: str) -> ReplicaBlocks:
        blocks = self.replicas.get(replica_id)
        if blocks is None:
            blocks = self.replicas[replica_id] = ReplicaBlocks(self.max_blocks_per_replica)
        return blocks

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def layouts(self, replica_ids: Iterable[str]) -> set[Layout]:
        """The (scheme, block size) pairs the given replicas' keys are computed in."""
        out = set()
        for replica_id in replica_ids:
            blocks = self.replicas.get(replica_id)
            if blocks is not None and (layout := blocks.layout) is not None:
                out.add(layout)
        return out

    def matched(
        self, replica_ids: Iterable[str], keys: Mapping[Layout, Sequence[BlockKey]]
    ) -> dict[str, int]:
        """Replica id -> the request's leading blocks it holds (`keys` in each layout)."""
        out: dict[str, int] = {}
        for replica_id in replica_ids:
            blocks = self.replicas.get(replica_id)
            layout = blocks.layout if blocks is not None else None
            out[replica_id] = blocks.matched(keys[layout]) if blocks and layout in keys else 0
        return out
