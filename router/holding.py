"""Holding requests while a model has no ready replica (scale from zero, a replica restarting).

Each model has one FIFO queue, bounded in requests and in the bytes of their bodies (which a
held request keeps in memory). A held request waits until its model has a replica again, its
hold timeout passes, or the queue was already full when it arrived. Waiters are
woken in arrival order; since nothing tells the queue when a replica's passive-failure backoff
ends, waiters also look again every `recheck` seconds.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class HoldRejected(Exception):
    """The request could not be held; `reason` is `full` or `timeout`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Waiter:
    __slots__ = ("future", "size")

    def __init__(self, future: asyncio.Future[None], size: int) -> None:
        self.future = future
        self.size = size


class HoldQueue:
    def __init__(self, max_size: int, max_bytes: int | None = None, recheck: float = 0.5) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.recheck = recheck
        self.bytes = 0
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Wake every waiter, oldest first, to look for a replica again."""
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_result(None)

    async def hold(self, ready: Callable[[], bool], timeout: float, size: int = 0) -> None:
        """Return once `ready()` is true; raise HoldRejected when the queue is full (in
        requests, or in bytes with this request's `size` added) or the timeout passes first."""
        if ready():
            return
        if len(self._waiters) >= self.max_size or (
            self.max_bytes is not None and self.bytes + size > self.max_bytes
        ):
            raise HoldRejected("full")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # One entry per request for its whole stay keeps the queue in arrival order.
        waiter = _Waiter(loop.create_future(), size)
        self._waiters.append(waiter)
        self.bytes += size
        try:
            while not ready():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise HoldRejected("timeout")
                if waiter.future.done():
                    waiter.future = loop.create_future()
                await asyncio.wait({waiter.future}, timeout=min(remaining, self.recheck))
        finally:
            self._waiters.remove(waiter)
            self.bytes -= size
