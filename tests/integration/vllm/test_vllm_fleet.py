"""`fleetllm up` over vLLM's CPU build: the autoscaler scales 1 -> 2 on a loaded vLLM
replica's own metrics, and back to 1 by draining a replica with no request cut."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from vllm_testkit import FLEET, MODEL, START_GUARD_S, Up, metric_sum, wait_until


@pytest.fixture(scope="module")
def fleet(
    vllm_manifest: Path, vllm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Up]:
    manifest = vllm_manifest.with_name("smollm2-vllm-scaled.yaml")
    manifest.write_text(FLEET)
    up = Up(manifest, tmp_path_factory.mktemp("up"), {"FLEETLLM_VLLM_PYTHON": str(vllm)})
    try:
        up.wait_for("replica ready", guard_s=START_GUARD_S)
        yield up
    finally:
        assert up.close() == 0


class Load:
    """Clients streaming completions in a loop until stopped: every answer (its finish
    reason and token count) and error kept."""

    def __init__(self, client: openai.OpenAI, clients: int, max_tokens: int) -> None:
        self.answers: list[tuple[str | None, int]] = []
        self.errors: list[BaseException] = []
        self.max_tokens = max_tokens
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        for _ in range(clients):
            self._pool.submit(self._run, client)

    def _run(self, client: openai.OpenAI) -> None:
        while not self._stop.is_set():
            try:
                stream = client.completions.create(
                    model=MODEL, prompt="Once upon a time", max_tokens=self.max_tokens,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                finish, tokens = None, 0
                for chunk in stream:
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                self.answers.append((finish, tokens))
            except Exception as exc:  # every failure is the test's business
                self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def _inflight(up: Up, url: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{up.port}/metrics", timeout=10.0).text
    return metric_sum(text, "fleetllm:router_inflight", replica=url)


def test_the_autoscaler_scales_to_two_on_a_loaded_vllm_replicas_metrics(fleet: Up) -> None:
    load = Load(fleet.client(), clients=6, max_tokens=48)
    try:
        (scaled,) = fleet.wait_for("scale", to=2, guard_s=START_GUARD_S)
        # The need came from vLLM's gauges: sequences running and waiting over its slots.
        assert scaled["replicas_from"] == 1 and "4 running" in scaled["reason"]
        # Under load until the new replica is ready: without it the law would soon scale
        # back down (a replica still starting counts as one fully loaded replica, no more).
        fleet.wait_for("replica ready", replica="smollm2-vllm-1", guard_s=START_GUARD_S)
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert load.answers and all(a == ("length", 48) for a in load.answers)


def test_scaling_down_drains_the_replica_and_cuts_no_request(fleet: Up) -> None:
    # Two long streams at a time: one on each replica (least load), below the need of two.
    load = Load(fleet.client(), clients=2, max_tokens=150)
    seen_draining_with_requests = False
    try:
        (scaled,) = fleet.wait_for("scale", to=1, guard_s=START_GUARD_S)
        assert scaled["replicas_from"] == 2
        (draining,) = fleet.wait_for("replica draining")
        (started,) = fleet.events("replica starting", replica=draining["replica"])[-1:]

        def stopped() -> bool:
            nonlocal seen_draining_with_requests
            if _inflight(fleet, started["url"]) > 0:
                seen_draining_with_requests = True
            return bool(fleet.events("replica stopped", replica=draining["replica"]))

        wait_until(stopped, "the drained replica stopped", guard_s=START_GUARD_S)
    finally:
        load.stop()
    (stopped_event,) = fleet.events("replica stopped", replica=draining["replica"])
    assert stopped_event["exit"] == "exit 0"
    # It drained while it still had a request open, and that request was answered whole.
    assert seen_draining_with_requests
    assert not load.errors, load.errors[:3]
    assert load.answers and all(a == ("length", 150) for a in load.answers)
