"""The status view: every field of a model in its plain line, a line only on change, and the
live table with bars while a model is prepared or a replica loads."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from fleetllm.local.policy import State
from fleetllm.local.status import (
    ModelView,
    RecentEvents,
    ReplicaView,
    StatusView,
    plain_line,
    table,
)


def _view(**changes: object) -> ModelView:
    fields: dict[str, object] = {
        "name": "tiny",
        "endpoint": "http://localhost:8000/v1",
        "desired": 2,
        "replicas": (
            ReplicaView("tiny-0", State.READY, "http://127.0.0.1:4000", 1, 30.0),
            ReplicaView("tiny-1", State.STARTING, "http://127.0.0.1:4001", 0, 3.2),
        ),
        "kv_usage": 0.375,
        "waiting": 4.0,
        "queue_p90_s": 1.25,
        "last_scale": "1 -> 2: queue time p90 1.25s above target 0.50s",
        "preparing": None,
    }
    fields.update(changes)
    return ModelView(**fields)  # type: ignore[arg-type]


def test_plain_line_carries_every_field() -> None:
    line = plain_line(_view())
    assert line.startswith("status model=tiny endpoint=http://localhost:8000/v1 replicas=1/2 ")
    for part in (
        "kv=38%",
        "waiting=4",
        "queue_p90=1.25s",
        "others=starting",
        "restarts=1",
        "last_scale='1 -> 2: queue time p90 1.25s above target 0.50s'",
    ):
        assert part in line
    unknown = plain_line(_view(kv_usage=None, waiting=None, queue_p90_s=None, last_scale=None))
    assert "kv=- waiting=- queue_p90=-" in unknown and "last_scale" not in unknown
    assert "preparing=10/272tensors" in plain_line(_view(preparing=(10, 272, "tensors")))


def test_plain_view_writes_a_line_per_change_not_per_refresh() -> None:
    out = io.StringIO()
    view = StatusView(out, live=False, min_interval_s=0.0)
    with view:
        view.show([_view()])
        view.show([_view()])
        view.show([_view(waiting=5.0)])
        view.show([_view(waiting=5.0)])
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "waiting=4" in lines[0] and "waiting=5" in lines[1]


def test_plain_view_holds_a_fast_change_back_until_the_interval_passed() -> None:
    out = io.StringIO()
    view = StatusView(out, live=False, min_interval_s=3600.0)
    view.show([_view()])
    view.show([_view(waiting=9.0)])
    assert out.getvalue().count("\n") == 1
    view.min_interval_s = 0.0
    view.show([_view(waiting=9.0)])
    assert "waiting=9" in out.getvalue().splitlines()[-1]


def test_live_table_shows_the_figures_and_progress_bars() -> None:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(table([_view(preparing=(68, 272, "tensors"))]))
    text = console.export_text()
    for part in ("tiny", "http://localhost:8000/v1", "1/2", "38%", "1.25s", "queue time p90"):
        assert part in text
    assert "tiny: converting the weights" in text and "68/272 tensors" in text
    assert "tiny-1: loading" in text
    assert "━" in text  # the bars are drawn
    console.print(table([_view(preparing=(3 * 2**20, 270 * 2**20, "bytes"))]))
    text = console.export_text()
    assert "tiny: downloading the weights" in text and "3/270 MiB" in text


def test_the_live_table_shows_what_of_the_plan_the_engine_does_not_apply() -> None:
    note = "gpu-memory-utilization 0.90 is not passed: vLLM on a CPU has no device memory"
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(table([_view(notes=(note,))]))
    assert f"tiny: note {note}" in " ".join(console.export_text().split())
    console.print(table([_view()]))
    assert "note" not in console.export_text()


def test_the_live_view_lists_the_latest_events_without_their_long_fields() -> None:
    events = RecentEvents(size=2)
    log = logging.getLogger("test.local-status")
    log.propagate = False
    log.addHandler(events)
    log.setLevel(logging.INFO)
    log.info("replica starting", extra={"replica": "tiny-0"})
    log.warning(
        "replica exited; restarting",
        extra={"replica": "tiny-0", "exit": "exit 1", "log_tail": ["Traceback"], "api_key": "k"},
    )
    log.info("replica ready", extra={"replica": "tiny-0"})
    assert len(events.lines) == 2
    restarted, ready = events.lines
    assert restarted.endswith(
        "warning replica exited; restarting replica=tiny-0 exit=exit 1 api_key=[redacted]"
    )
    assert "Traceback" not in restarted
    assert ready.endswith(" replica ready replica=tiny-0")

    out = io.StringIO()
    view = StatusView(out, live=True, events=events, title="fleetllm up: http://x/v1")
    with view:
        view.show([_view()])
    text = out.getvalue()
    assert "fleetllm up: http://x/v1" in text and "ready/desired" in text
    assert "replica ready replica=tiny-0" in text
