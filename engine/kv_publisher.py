"""The engine's KV-event publisher: vLLM's ZeroMQ transport (`fleetllm.kv_events`), fed by the
engine thread without ever blocking it.

The engine thread encodes each step's events as one batch, numbers it and pushes it onto a
bounded in-process queue (a ZeroMQ PUSH/PULL pair, high-water mark `max_queue_size`); when the
queue is full the batch is dropped and counted, never waited for. Its sequence number is used
all the same, so subscribers see the gap, and a replay cannot fill it: they know their view
of this engine is incomplete. A publisher thread sends queued batches on the PUB socket, keeps
the last `buffer_steps` of them, and answers replay requests on the ROUTER socket from that
buffer, as vLLM's `ZmqEventPublisher` does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from fleetllm.kv_events import END_SEQ, KVEvent, KVEventBatch, KVEventsConfig, encoder

log = logging.getLogger(__name__)

_POLL_MS = 200  # how often an idle publisher thread looks whether it should stop


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc addresses are bound, others connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, on_drop: Callable[[], None] | None = None) -> None:
        self.config = config
        self.on_drop = on_drop
        """Called (on the engine thread) for each batch dropped because the queue was full."""
        self.dropped = 0
        self._topic = config.topic.encode()
        self._seq = itertools.count()
        self._encode = encoder().encode
        self._ctx = zmq.Context()
        self._queue_address = f"inproc://kv-events-queue-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        # The queue is the two ends' buffers together: the PUSH end holds the bound.
        self._pull.setsockopt(zmq.RCVHWM, 1)
        self._pull.bind(self._queue_address)
        self._push: zmq.Socket[bytes] | None = None  # the engine thread's, made on first use
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {exc.strerror}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info(
            "publishing KV events",
            extra={"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint},
        )

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch; never blocks (a full queue drops it). Engine thread only."""
        if self._push is None:
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.set_hwm(self.config.max_queue_size)
            self._push.connect(self._queue_address)
        seq = next(self._seq)
        payload = self._encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        try:
            self._push.send_multipart((seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop()

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._running = False
        self._thread.join(timeout + _POLL_MS / 1000)
        if self._push is not None:
            self._push.close(linger=0)
        self._close_sockets()
        self._ctx.term()

    def _close_sockets(self) -> None:
        for sock in (self._pull, self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running:
            ready = dict(poller.poll(_POLL_MS))
            try:
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
                if ready.get(self._pull):
                    self._send_queued()
            except zmq.ZMQError as exc:
                log.warning("KV event publishing failed", extra={"error": str(exc)})
        self._send_queued()  # what the engine queued before it stopped

    def _send_queued(self) -> None:
        while True:
            try:
                seq_bytes, payload = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))

    def _serve_replay(self) -> None:
        """One replay request: (identity, empty, start seq) -> every buffered batch from
        start on, then the end marker. A malformed request gets the end marker alone."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        client = frames[0]
        start = None
        if len(frames) == 3 and len(frames[2]) == 8:
            start = int.from_bytes(frames[2], "big")
        if start is not None:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
