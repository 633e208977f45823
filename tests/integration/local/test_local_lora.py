"""`fleetllm up` with LoRA on the builtin engine (the tiny model and a PEFT adapter of it made
here): two replicas and one adapter; every request for the adapter lands on a replica that
holds it (one without it would answer 404, and none does), and the holder killed, its replica
restarts and holds the adapter again before it takes a request. The same acceptance runs over
vLLM's CPU build in the vLLM tier (tests/integration/vllm/test_vllm_lora_fleet.py)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from local_testkit import Up
from peft_adapters import write_lora
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.lora_api import parse_adapters

MODEL = "tiny-chat"
ADAPTER = "sql"


@pytest.fixture(scope="module")
def fleet(
    tiny_manifest: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("lora")
    adapter = write_lora(tiny_model_dir, folder / ADAPTER, seed=1)
    # The tiny model at two replicas (no autoscaling), with the adapter.
    text = tiny_manifest.read_text().split("  scaling:", maxsplit=1)[0]
    text = text.replace("file://tiny-chat", f"file://{tiny_model_dir}")
    text += "  replicas: 2\n  lora: {maxLoras: 1, maxLoraRank: 8}\n"
    text += f"  adapters:\n  - {{name: {ADAPTER}, source: 'file://{adapter}'}}\n"
    manifest = folder / "tiny-lora.yaml"
    manifest.write_text(text)
    up = Up(["-f", str(manifest)], tmp_path_factory.mktemp("up-lora"))
    try:
        up.wait_for("replica ready", count=2, guard_s=180)
        yield up
    finally:
        up.close()


def _upstream(up: Up, outcome: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{up.port}/metrics", timeout=10.0).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "fleetllm:router_upstream_requests_total" and s.labels["code"] == outcome
    )


def _holds(url: str) -> bool:
    return parse_adapters(httpx.get(f"{url}/v1/models", timeout=10.0).content).get(ADAPTER) == MODEL


def _ask(up: Up, count: int) -> None:
    client = up.client()
    for i in range(count):
        answer = client.completions.create(model=ADAPTER, prompt=f"SELECT {i}", max_tokens=4)
        assert answer.model == ADAPTER


def test_adapter_requests_land_on_holders_and_a_restarted_holder_gets_it_back(fleet: Up) -> None:
    starts = {e["replica"]: e for e in fleet.find("replica starting")}
    assert len(starts) == 2
    for name, start in starts.items():
        assert fleet.find("adapter loaded", replica=name, url=start["url"])
        assert _holds(start["url"])
    _ask(fleet, 8)
    assert _upstream(fleet, "200") == 8 and _upstream(fleet, "404") == 0

    victim = sorted(starts)[0]
    # The replica's engine (a child of its guard, the process the supervisor started).
    (engine,) = [p for p in fleet.engines() if p.ppid() == starts[victim]["pid"]]
    engine.send_signal(signal.SIGKILL)
    fleet.wait_for("replica exited; restarting", replica=victim)
    fleet.wait_for("replica ready", count=3, guard_s=180)
    restarted = fleet.find("replica starting", replica=victim)[-1]
    assert fleet.find("adapter loaded", replica=victim, url=restarted["url"])
    assert _holds(restarted["url"])
    # (The dead replica's series left the router with it: count from here.)
    before = _upstream(fleet, "200")
    _ask(fleet, 8)
    assert _upstream(fleet, "200") - before == 8 and _upstream(fleet, "404") == 0
