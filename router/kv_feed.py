"""One replica's KV events over ZeroMQ, kept in its view (`kv_index`): the I/O half.

A SUB socket receives the replica's batches as they are published; a DEALER socket asks its
replay endpoint for the batches from a sequence number on. The feed replays at start, after
any gap or sign of a restart, and every `probe_interval` seconds: that last replay (usually
answered with the one batch the view already ends on) proves the publisher alive and the view
current, and finds batches lost at the end of the stream, which no later batch would reveal.
The view is fresh while the last replay answered less than `stale_after` seconds ago (so a
replica must publish with a replay endpoint: nothing else can prove its view current).

Everything a replica sends is bounded: each message by `max_message_bytes` (ZeroMQ drops
the connection of a peer that sends more), the SUB queue by its high-water mark (an overflow
is a gap, which a replay repairs), one replay answer by `max_replay_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from fleetllm.kv_events import END_SEQ
from fleetllm.router.kv_index import BatchSequencer, Resync

log = logging.getLogger("fleetllm.router")


@dataclass(frozen=True)
class FeedSettings:
    probe_interval: float = 1.0
    stale_after: float = 3.0
    replay_timeout: float = 2.0
    max_message_bytes: int = 1 << 20
    max_replay_bytes: int = 64 << 20
    receive_hwm: int = 256


@dataclass(eq=False)
class KVFeed:
    context: zmq.asyncio.Context
    endpoint: str
    replay_endpoint: str
    sequencer: BatchSequencer
    settings: FeedSettings
    fresh_until: float = field(default=-1.0, init=False)
    batches: int = field(default=0, init=False)

    def fresh(self, now: float) -> bool:
        return now < self.fresh_until and self.sequencer.blocks.mismatch is None

    async def run(self) -> None:
        """Follow the replica until cancelled; a socket error is logged and the feed starts
        over (the view stays, and is checked by the first replay)."""
        while True:
            try:
                await self._follow()
            except zmq.ZMQError as exc:
                log.warning(
                    "KV events of a replica cannot be followed",
                    extra={"endpoint": self.endpoint, "error": str(exc)},
                )
                await asyncio.sleep(self.settings.stale_after)

    async def _follow(self) -> None:
        settings = self.settings
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
        sub.setsockopt(zmq.RCVHWM, settings.receive_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        dealer: zmq.asyncio.Socket | None = None
        try:
            sub.connect(self.endpoint)
            pending: Resync | None = Resync(0, "first sync")
            next_probe = 0.0
            while True:
                if pending is not None or time.monotonic() >= next_probe:
                    dealer = dealer or self._dealer()
                    start = self.sequencer.check_start if pending is None else pending.start
                    answer, whole = await self._replay(dealer, start)
                    if not whole:
                        dealer.close()
                        dealer = None  # the rest of it must not be read as the next answer
                    pending = None
                    if answer is not None:
                        pending = self.sequencer.on_replay(start, answer)
                        self.fresh_until = time.monotonic() + settings.stale_after
                    next_probe = time.monotonic() + settings.probe_interval
                if not await sub.poll(max(0.0, next_probe - time.monotonic()) * 1000):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue  # not a batch (vLLM's frames are topic, seq, payload)
                self.batches += 1
                pending = self.sequencer.on_live(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)
            if dealer is not None:
                dealer.close(linger=0)

    def _dealer(self) -> zmq.asyncio.Socket:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        return dealer

    async def _replay(
        self, dealer: zmq.asyncio.Socket, start: int
    ) -> tuple[list[tuple[int, bytes]] | None, bool]:
        """The batches the replica still buffers from `start` on, and whether that is the
        whole answer: at most max_replay_bytes of it are read (the rest comes with the next
        replay); None when the replica does not answer in time."""
        settings = self.settings
        out: list[tuple[int, bytes]] = []
        size = 0
        try:
            async with asyncio.timeout(settings.replay_timeout):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:
                        continue
                    if frames[2] == END_SEQ:
                        return out, True
                    size += len(frames[3])
                    if size > settings.max_replay_bytes:
                        return out or None, False
                    out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            return None, False


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
