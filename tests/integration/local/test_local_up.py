"""`fleetllm up` with real processes on a tiny random-weight model: the official openai
client through the router, a killed engine restarted while no request is dropped, and a stop
that drains, exits 0 and leaves no process behind (also when the supervisor is killed).

The tests of this module share one fleet, in order; the last one stops it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from local_testkit import Up, alive, snapshot, survivors, wait_until

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
    assert len(chunks) > 2
    assert text == whole  # greedy: the same answer, whole or streamed
    status = fleet.status_path.read_text()
    assert f"model={MODEL} endpoint=http://localhost:{fleet.port}/v1 replicas=1/1" in status


def test_a_killed_engine_is_restarted_and_no_request_is_dropped(fleet: Up) -> None:
    client = fleet.client()
    engine = fleet.engines()[0]
    exited_before = len(fleet.find("replica exited; restarting"))
    ready_before = len(fleet.find("replica ready"))
    answers: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def load() -> None:
        # Requests keep arriving before, during and after the engine is down.
        while not done.is_set():
            try:
                answers.append(_chat(client))
            except BaseException as exc:
                errors.append(exc)

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(load)
        wait_until(lambda: len(answers) >= 8, "requests flow")
        engine.kill()
        restarted = fleet.wait_for("replica exited; restarting", count=exited_before + 1)[-1]
        assert restarted["exit"] == "killed by SIGKILL"
        fleet.wait_for("replica ready", count=ready_before + 1, guard_s=120)
        served = len(answers)
        wait_until(lambda: len(answers) >= served + 8, "requests flow to the new engine")
        done.set()
    assert not errors, errors[:3]
    new_engines = fleet.engines()
    assert engine.pid not in {p.pid for p in new_engines} and not alive(engine)
    assert new_engines


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


def test_a_killed_supervisor_takes_every_replica_with_it(
    fixed_manifest: Callable[[int], Path], tmp_path: Path
) -> None:
    up = Up(["-f", str(fixed_manifest(2))], tmp_path / "up")
    try:
        up.wait_for("replica ready", count=2, guard_s=180)
        tree = snapshot(p.pid for p in up.tree())
        assert len(up.engines()) == 2 and len(tree) >= 4
        assert up.stop(signal.SIGKILL) == -signal.SIGKILL
        wait_until(lambda: not survivors(tree), "every replica process ended")
    finally:
        up.close()
