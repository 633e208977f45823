"""`fleetllm up` with LoRA over vLLM's CPU build: two replicas and one adapter (a PEFT adapter of
SmolLM2 made here). Every replica loads the adapter before the router sends it anything, so
every request for the adapter lands on a replica that holds it (a replica without it would
answer 404, and none does); the holder killed, its replica restarts and holds the adapter
again before it takes a request."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from peft_adapters import write_lora
from vllm_testkit import MANIFEST, MODEL, START_GUARD_S, Up, metric_sum

from fleetllm.engine.model_files import resolve_model
from fleetllm.lora_api import parse_adapters

ADAPTER = "sql"


@pytest.fixture(scope="module")
def lora_fleet(
    vllm_manifest: Path, vllm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("adapters") / ADAPTER
    write_lora(resolve_model("builtin://smollm2-135m"), folder, seed=1)
    manifest = vllm_manifest.with_name("smollm2-vllm-lora.yaml")
    manifest.write_text(
        MANIFEST
        + "  replicas: 2\n"
        + "  lora: {maxLoras: 1, maxLoraRank: 8}\n"
        + f"  adapters:\n  - {{name: {ADAPTER}, source: 'file://{folder}'}}\n"
    )
    up = Up(manifest, tmp_path_factory.mktemp("up-lora"), {"FLEETLLM_VLLM_PYTHON": str(vllm)})
    try:
        up.wait_for("replica ready", count=2, guard_s=2 * START_GUARD_S)
        yield up
    finally:
        assert up.close() == 0


def _upstream(up: Up, outcome: str) -> dict[str, float]:
    """Attempts the router sent each replica for the model, by their answer's status."""
    text = httpx.get(f"http://127.0.0.1:{up.port}/metrics", timeout=10.0).text
    urls = {e["url"] for e in up.events("replica starting")}
    return {
        url: metric_sum(text, "fleetllm:router_upstream_requests_total", replica=url, code=outcome)
        for url in urls
    }


def _holds(url: str) -> bool:
    listing = httpx.get(f"{url}/v1/models", timeout=10.0).content
    return parse_adapters(listing).get(ADAPTER) == MODEL


def _ask(up: Up, count: int) -> None:
    client = up.client()
    for i in range(count):
        answer = client.completions.create(model=ADAPTER, prompt=f"SELECT {i}", max_tokens=4)
        assert answer.model == ADAPTER and answer.choices[0].text


def test_adapter_requests_land_on_holders_and_a_restarted_holder_gets_it_back(
    lora_fleet: Up,
) -> None:
    up = lora_fleet
    starts = {e["replica"]: e for e in up.events("replica starting")}
    assert len(starts) == 2
    # Loaded on each replica before it was ready.
    for name, start in starts.items():
        (loaded,) = up.events("adapter loaded", replica=name, url=start["url"])
        assert loaded["adapter"] == ADAPTER
        assert _holds(start["url"]), name
    _ask(up, 8)
    served = _upstream(up, "200")
    assert sum(served.values()) == 8
    assert not any(_upstream(up, "404").values()), "a replica without the adapter got one"

    # The busier holder dies; its replica restarts and has the adapter again when it is ready.
    victim = max(starts, key=lambda name: served[starts[name]["url"]])
    os.killpg(starts[victim]["pid"], signal.SIGKILL)
    up.wait_for("replica exited; restarting", replica=victim)
    up.wait_for("replica ready", count=3, guard_s=START_GUARD_S)
    restarted = up.events("replica starting", replica=victim)[-1]
    assert restarted["url"] != starts[victim]["url"] or restarted["pid"] != starts[victim]["pid"]
    assert up.events("adapter loaded", url=restarted["url"])
    assert _holds(restarted["url"])
    # (The dead replica's series left the router with it: count from here.)
    before = sum(_upstream(up, "200").values())
    _ask(up, 8)
    assert sum(_upstream(up, "200").values()) - before == 8
    assert not any(_upstream(up, "404").values())
