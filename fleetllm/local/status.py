"""The status view of `fleetllm up`: what it shows (a pure snapshot per model), drawn as a live
rich table on a terminal, or as plain lines, one per change, anywhere else (logs, CI)."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from fleetllm.local.policy import State
from fleetllm.logs import JSONFormatter

EVENT_LINES = 8
# Fields too long for an event line (they stay in the log file).
_LONG_FIELDS = frozenset({"log_tail", "log", "exc"})


@dataclass(frozen=True)
class ReplicaView:
    name: str
    state: State
    url: str | None
    restarts: int
    state_s: float
    """Seconds in the current state."""


@dataclass(frozen=True)
class ModelView:
    name: str
    endpoint: str
    desired: int
    replicas: tuple[ReplicaView, ...]
    kv_usage: float | None
    """Mean KV-cache usage of the ready replicas, 0..1; None before the first scrape."""
    waiting: float | None
    """Requests waiting in the replicas' queues."""
    queue_p90_s: float | None
    """90th percentile of the time requests waited for a slot, over the autoscaler's window."""
    last_scale: str | None
    preparing: tuple[int, int, str] | None
    """(done, total, unit) while the model's weights are pulled ("bytes") or converted
    ("tensors")."""
    problem: str | None = None
    notes: tuple[str, ...] = ()
    """What of the plan the engine does not apply on this machine (shown under the model)."""

    @property
    def ready(self) -> int:
        return sum(r.state is State.READY for r in self.replicas)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def plain_line(view: ModelView) -> str:
    """One line for logs: every field of the view, as `key=value`."""
    fields = [
        f"model={view.name}",
        f"endpoint={view.endpoint}",
        f"replicas={view.ready}/{view.desired}",
        f"kv={_percent(view.kv_usage)}",
        f"waiting={_number(view.waiting)}",
        f"queue_p90={_seconds(view.queue_p90_s)}",
    ]
    states = [r.state for r in view.replicas if r.state is not State.READY]
    if states:
        fields.append("others=" + ",".join(sorted(states)))
    if view.restarts:
        fields.append(f"restarts={view.restarts}")
    if view.preparing is not None:
        done, total, unit = view.preparing
        fields.append(f"preparing={done}/{total}{unit}")
    if view.problem:
        fields.append(f"problem={view.problem!r}")
    if view.last_scale:
        fields.append(f"last_scale={view.last_scale!r}")
    return "status " + " ".join(fields)


class RecentEvents(logging.Handler):
    """The last log records, one short line each, for the live view (the full JSON records
    go to the log file)."""

    def __init__(self, size: int = EVENT_LINES) -> None:
        super().__init__()
        self.lines: deque[str] = deque(maxlen=size)
        self._json = JSONFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        entry = json.loads(self._json.format(record))
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(
            f"{key}={value}"
            for key, value in entry.items()
            if key not in ("ts", "level", "logger", "msg") and key not in _LONG_FIELDS
        )
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()} "
        self.lines.append(f"{stamp} {level}{entry['msg']} {fields}".rstrip())


def table(
    views: Sequence[ModelView], events: Sequence[str] = (), title: str = "fleetllm up"
) -> RenderableType:
    """The live view: one row per model, a bar per model being prepared and per replica
    loading, then the latest events."""
    grid = Table(title=title, title_justify="left", expand=True)
    for column in ("model", "endpoint", "ready/desired", "KV", "waiting", "queue p90"):
        grid.add_column(column, no_wrap=True)
    grid.add_column("last scale", ratio=1)
    bars = Table.grid(padding=(0, 1))
    for view in views:
        ready = Text(f"{view.ready}/{view.desired}")
        if view.ready < view.desired:
            ready.stylize("yellow")
        grid.add_row(
            view.name,
            view.endpoint,
            ready,
            _percent(view.kv_usage),
            _number(view.waiting),
            _seconds(view.queue_p90_s),
            view.problem or view.last_scale or "",
        )
        for note in view.notes:
            bars.add_row(f"{view.name}: note", Text(note, style="dim"), "")
        if view.preparing is not None:
            done, total, unit = view.preparing
            if unit == "bytes":
                what, amount = "downloading", f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB"
            else:
                what, amount = "converting", f"{done}/{total} {unit}"
            bars.add_row(
                f"{view.name}: {what} the weights",
                ProgressBar(total=total, completed=done, width=40),
                amount,
            )
        for replica in view.replicas:
            if replica.state is State.STARTING:
                bars.add_row(
                    f"{replica.name}: loading",
                    ProgressBar(total=None, width=40),
                    f"{replica.state_s:.0f}s",
                )
            elif replica.state is not State.READY:
                bars.add_row(f"{replica.name}: {replica.state}", "", f"{replica.state_s:.0f}s")
    parts: list[RenderableType] = [grid]
    if bars.row_count:
        parts.append(bars)
    if events:
        parts.append(Text("\n".join(events), style="dim", no_wrap=True, overflow="ellipsis"))
    return Group(*parts)


class StatusView:
    """Shows the views it is given: redrawn in place on a terminal, else a plain line per
    model whenever that model's line changes (at most one per `min_interval_s`)."""

    def __init__(
        self,
        stream: TextIO,
        *,
        live: bool | None = None,
        min_interval_s: float = 2.0,
        events: RecentEvents | None = None,
        title: str = "fleetllm up",
    ) -> None:
        self.stream = stream
        self.title = title
        self.live = stream.isatty() if live is None else live
        self.min_interval_s = min_interval_s
        self.events = events
        self._last: dict[str, tuple[str, float]] = {}
        self._live: Live | None = None

    def __enter__(self) -> StatusView:
        if self.live:
            console = Console(file=self.stream)
            self._live = Live(console=console, auto_refresh=False, redirect_stderr=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def show(self, views: Sequence[ModelView]) -> None:
        if self._live is not None:
            events = self.events.lines if self.events is not None else ()
            self._live.update(table(views, events, self.title), refresh=True)
            return
        now = time.monotonic()
        for view in views:
            line = plain_line(view)
            previous = self._last.get(view.name)
            if previous is not None and (
                previous[0] == line or now - previous[1] < self.min_interval_s
            ):
                continue
            self._last[view.name] = (line, now)
            self.stream.write(line + "\n")
            self.stream.flush()
