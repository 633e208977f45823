"""`fleetllm up` with real processes on a tiny random-weight model: the official openai
client through the router, a killed engine restarted while no request is dropped, and a stop
that drains, exits 0 and leaves no process behind (also when the supervisor is killed).

The tests of this module share one fleet, in order; the last one stops it.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from local_testkit import Up, alive, snapshot, survivors, wait_until

from fleetllm.autoscale.settings import LawSettings

MODEL = "tiny-chat"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GRACE_S = 20


@pytest.fixture(scope="module")
def fleet(tiny_manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    up = Up(
        ["-f", str(tiny_manifest), "--shutdown-grace-period", str(GRACE_S)],
        tmp_path_factory.mktemp("up"),
    )
    try:
        up.wait_for("replica ready", guard_s=180)
        yield up
    finally:
        up.close()


def _chat(client: openai.OpenAI, max_tokens: int = 8) -> str:
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0
    )
    assert answer.model == MODEL and answer.choices[0].finish_reason == "length"
    return answer.choices[0].message.content or ""


class Load:
    """Clients sending chat requests in a loop until stopped; every answer and error kept."""

    def __init__(self, client: openai.OpenAI, clients: int, max_tokens: int) -> None:
        self.answers: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        for _ in range(clients):
            self._pool.submit(self._run, client, max_tokens)

    def _run(self, client: openai.OpenAI, max_tokens: int) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append(_chat(client, max_tokens))
            except BaseException as exc:
                self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def test_openai_client_chats_and_streams_through_the_router(fleet: Up) -> None:
    client = fleet.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    whole = _chat(client, max_tokens=16)
    assert whole
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The role opens the stream on a chunk of its own; the tokens follow in one chunk or more
    # (a client that falls behind gets them merged), the last with the finish reason.
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text == whole  # greedy: the same answer, whole or streamed
    line = f"status model={MODEL} endpoint=http://localhost:{fleet.port}/v1 replicas=1/1 "
    wait_until(lambda: line in fleet.status_path.read_text(), "the status line shows it")


def test_a_malformed_request_is_one_warning_line_without_its_bytes(fleet: Up) -> None:
    secret, prompt = "sk-never-logged-0123456789", "the-private-prompt-text"
    body = f'{{"model": "{MODEL}", "prompt": "{prompt}"}}'.encode()
    raw = (  # bare-LF line endings: the HTTP parser refuses them
        b"POST /v1/completions HTTP/1.1\nHost: x\n"
        + f"Authorization: Bearer {secret}\nContent-Length: {len(body)}\n\n".encode()
        + body
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", fleet.port), timeout=30) as s:
            s.sendall(raw)
            assert s.recv(65536).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    (line,) = fleet.wait_for("malformed HTTP request refused")
    assert (line["level"], line["status"], line["peer"]) == ("warning", 400, "127.0.0.1")
    time.sleep(0.5)  # the others would have been logged by now: they are counted instead
    assert len(fleet.find("malformed HTTP request refused")) == 1
    logs = fleet.events_path.read_text() + "".join(
        p.read_text(errors="replace") for p in (fleet.workdir / "logs").glob("*.log")
    )
    assert secret not in logs and prompt not in logs


def test_a_killed_engine_is_restarted_and_no_request_is_dropped(fleet: Up) -> None:
    # The model's only replica: while it is down the router holds the requests.
    (engine,) = fleet.engines()
    exited_before = len(fleet.find("replica exited; restarting"))
    load = Load(fleet.client(), clients=4, max_tokens=8)
    try:
        wait_until(lambda: len(load.answers) >= 8, "requests flow")
        engine.kill()
        (restarted,) = fleet.wait_for("replica exited; restarting", count=exited_before + 1)[-1:]
        assert restarted["exit"] == "killed by SIGKILL" and restarted["replica"] == "tiny-0"
        fleet.wait_for("replica ready", count=2, replica="tiny-0", guard_s=120)
        served = len(load.answers)
        wait_until(lambda: len(load.answers) >= served + 8, "requests flow to the new engine")
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    (new_engine,) = fleet.engines()
    assert new_engine.pid != engine.pid and not alive(engine)
    wait_until(lambda: "restarts=1" in fleet.status_path.read_text(), "status: 1 restart")


def test_sustained_concurrent_load_scales_up_to_two(fleet: Up) -> None:
    assert len(fleet.engines()) == 1
    load = Load(fleet.client(), clients=12, max_tokens=32)
    try:
        (scaled,) = fleet.wait_for("scale", to=2, guard_s=120)
        assert scaled["replicas_from"] == 1 and "running" in scaled["reason"]
        fleet.wait_for("replica ready", replica="tiny-1", guard_s=120)
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert len(fleet.engines()) == 2
    wait_until(lambda: "replicas=2/2" in fleet.status_path.read_text(), "status shows 2/2")


def test_idle_scales_back_to_one_after_the_delay(fleet: Up) -> None:
    # The law does not go back to a count it had to grow from while the request rate over its
    # window is as high as when it grew (`Autoscaler._too_few_floor`): after the burst above,
    # that can last the whole window, and the scale-down delay comes on top.
    window_s = LawSettings().queue_window_seconds
    (scaled,) = fleet.wait_for("scale", to=1, guard_s=window_s + 60)
    assert scaled["replicas_from"] == 2
    assert "every recommendation of the last 4s was at most 1" in scaled["reason"]
    # The replica that goes is drained first, then stopped cleanly.
    (drained,) = fleet.wait_for("replica draining")
    (stopped,) = fleet.wait_for("replica stopped", replica=drained["replica"])
    assert stopped["exit"] == "exit 0"
    wait_until(lambda: len(fleet.engines()) == 1, "one engine left")
    line = f"last_scale='2 -> 1: {scaled['reason']}'"
    wait_until(lambda: line in fleet.status_path.read_text(), "status: the last scale")
    assert _chat(fleet.client())


def test_sigterm_drains_exits_0_and_no_child_is_left(fleet: Up) -> None:
    client = fleet.client()
    tree = snapshot(p.pid for p in fleet.tree())
    assert len(tree) >= 2  # a guard and its engine at least
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0, stream=True
    )
    first = next(iter(stream))
    started = time.monotonic()
    fleet.proc.send_signal(signal.SIGTERM)
    # The open stream is drained, not cut.
    rest = list(stream)
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert fleet.proc.wait(GRACE_S + 10) == 0
    assert time.monotonic() - started < GRACE_S + 10
    assert not survivors(tree)
    assert fleet.find("fleet stopped")


def test_a_busy_port_is_a_clear_error_before_anything_starts(
    fixed_manifest: Callable[[int], Path], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = Up(["-f", str(fixed_manifest(1))], tmp_path / "up", port=port)
        try:
            assert up.proc.wait(60) == 1
        finally:
            up.close()
    assert f"fleetllm up: cannot listen on 127.0.0.1:{port}" in up.events_path.read_text()
    assert not up.find("replica starting")


def test_a_killed_supervisor_takes_every_replica_with_it_and_a_terminal_gets_a_live_view(
    fixed_manifest: Callable[[int], Path], tmp_path: Path
) -> None:
    # On a terminal, so that the live view runs too.
    up = Up(["-f", str(fixed_manifest(2))], tmp_path / "up", tty=True)
    try:
        up.wait_for("replica ready", count=2, guard_s=180)
        wait_until(
            lambda: (
                "ready model=tiny-chat replica=tiny-1"
                in up.status_path.read_text("utf-8", "replace")
            ),
            "the live view shows the events",
        )
        screen = up.status_path.read_text(errors="replace")
        assert "ready/desired" in screen and f"http://localhost:{up.port}/v1" in screen
        tree = snapshot(p.pid for p in up.tree())
        assert len(up.engines()) == 2 and len(tree) >= 4
        assert up.stop(signal.SIGKILL) == -signal.SIGKILL
        wait_until(lambda: not survivors(tree), "every replica process ended")
    finally:
        up.close()
