"""What watches yield: events decoded from a watch answer's lines, the `Resync` that `follow`
sends after each list, and the backoff between failed watches."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fleetllm.kube.errors import error_from_watch


@dataclass(frozen=True)
class WatchEvent:
    type: str
    """ADDED, MODIFIED, DELETED or BOOKMARK."""
    object: dict[str, Any]

    @property
    def resource_version(self) -> str | None:
        return (self.object.get("metadata") or {}).get("resourceVersion")


@dataclass(frozen=True)
class Resync:
    """`follow` listed the resource again: these are all the objects there are now; anything
    not among them is gone."""

    items: list[dict[str, Any]]
    resource_version: str


class WatchDecoder:
    """A watch answer's body, one JSON event a line, as chunks of bytes arrive: a line may
    span chunks. An ERROR event raises ApiError (410 Gone: list again)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[WatchEvent]:
        """The events the lines completed by `chunk` hold, in order."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            event = json.loads(line)
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":
                raise error_from_watch(obj, self.path)
            yield WatchEvent(str(event.get("type")), obj)


@dataclass
class Backoff:
    """Exponential delays with jitter, reset after a success."""

    initial: float = 0.5
    maximum: float = 30.0
    failures: int = field(default=0, init=False)

    def next(self) -> float:
        delay = min(self.maximum, self.initial * 2.0**self.failures)
        self.failures += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0
