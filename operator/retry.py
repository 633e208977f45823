"""Reconciling through API outages: retried without limit, each wait doubling up to a cap, so
that an update made while the control plane was away (an upgrade, a partition) is applied once
it is back. The wait is injected (tests play ten minutes of outage in no time)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import aiohttp

from fleetllm.kube.errors import ApiError
from fleetllm.kube.login import LoginError
from fleetllm.operator.reconciler import Outcome, Reconciler

logger = logging.getLogger("fleetllm.operator")

Sleep = Callable[[float], Awaitable[None]]
# What an unreachable or overloaded API server raises; any other error is a bug or a refusal
# that retrying cannot cure.
TRANSIENT = (TimeoutError, ApiError, LoginError, aiohttp.ClientError)


@dataclass(frozen=True)
class Backoff:
    first_seconds: float = 1.0
    max_seconds: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.max_seconds, self.first_seconds * 2.0 ** min(attempt, 32))

    def __iter__(self) -> Iterator[float]:
        """The waits of one request retried for as long as it fails (kopf's form of a
        backoff: an iterable without a length retries without limit)."""
        return map(self.delay, itertools.count())


def transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT) and not (isinstance(exc, ApiError) and not exc.retryable)


async def reconcile_until_done(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    backoff: Backoff,
    sleep: Sleep = asyncio.sleep,
) -> Outcome | None:
    """Reconcile, retrying transient failures for as long as they last."""
    attempt = 0
    while True:
        try:
            return await reconciler.reconcile(namespace, name)
        except TRANSIENT as exc:
            if not transient(exc):
                raise
            delay = backoff.delay(attempt)
            logger.warning(
                "reconcile failed, retrying",
                extra={
                    "llmdeployment": f"{namespace}/{name}",
                    "error": str(exc),
                    "attempt": attempt,
                    "retry_in_seconds": delay,
                },
            )
            attempt += 1
            await sleep(delay)
