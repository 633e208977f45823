"""The supervisor's decisions, as pure functions: when a crashed replica starts again, and
which replicas go when a model has too many."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

RESTART_BASE_S = 1.0
RESTART_CAP_S = 60.0
STABLE_AFTER_S = 60.0
"""A replica that served this long before it failed starts its backoff from the beginning."""


class State(enum.StrEnum):
    PENDING = "pending"
    """Waiting for a GPU."""
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    """Exited unexpectedly; starts again when its backoff has passed."""


def restart_delay(failures: int) -> float:
    """Seconds before the next start after `failures` failures in a row: 1, 2, 4, ... 60."""
    if failures < 1:
        return 0.0
    return min(RESTART_CAP_S, RESTART_BASE_S * 2 ** min(failures - 1, 30))


def failures_after_exit(failures: int, served_s: float | None) -> int:
    """The failure count once a replica has exited unexpectedly, having been ready for
    `served_s` seconds (None: it never became ready)."""
    if served_s is not None and served_s >= STABLE_AFTER_S:
        return 1
    return failures + 1


@dataclass(frozen=True)
class Candidate:
    """What the scale-down choice looks at."""

    key: int
    state: State
    in_flight: int


# Replicas that serve nothing yet go first, then the least busy; among equals the newest.
_STOP_ORDER = {
    State.PENDING: 0,
    State.BACKOFF: 0,
    State.STARTING: 1,
    State.READY: 2,
}


def to_retire(candidates: Sequence[Candidate], desired: int) -> list[int]:
    """Keys of the replicas to retire so that `desired` stay (draining and stopping ones are
    already on their way out and do not count)."""
    active = [c for c in candidates if c.state in _STOP_ORDER]
    excess = len(active) - max(0, desired)
    if excess <= 0:
        return []
    ordered = sorted(active, key=lambda c: (_STOP_ORDER[c.state], c.in_flight, -c.key))
    return [c.key for c in ordered[:excess]]
