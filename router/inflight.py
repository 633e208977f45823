"""What all clients together may make the router hold at once: requests open and the bytes
of their bodies. Past either cap a request is answered 503 with `Retry-After` before its body
is read, so that no number of keys (or one key without a cap of its own) can take the
router's memory. Bodies of unknown length (chunked) count as the largest body allowed until
they have been read."""

from __future__ import annotations

from fleetllm.router.errors import RouterError

RETRY_AFTER_SECONDS = 1


class Hold:
    """One request's share of the budget, from admission until `release`."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: InFlight, size: int) -> None:
        self._budget = budget
        self.size = size

    def resize(self, size: int) -> None:
        """The body's real size, once it has been read (or rewritten)."""
        self._budget.bytes += size - self.size
        self.size = size

    def release(self) -> None:
        self._budget.requests -= 1
        self._budget.bytes -= self.size
        self.size = 0

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class InFlight:
    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0

    def hold(self, size: int) -> Hold:
        """Admit a request whose body is (at most) `size` bytes; 503 when it does not fit."""
        if self.requests >= self.max_requests or self.bytes + size > self.max_bytes:
            raise RouterError(
                503,
                "The router is at capacity; try again shortly.",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.requests += 1
        self.bytes += size
        return Hold(self, size)
