"""KV events between fleetllm and vLLM, both ways: vLLM's own decoder classes (run in vLLM's
environment) read the builtin engine's batches, and the router's index over real vLLM
replicas sees their BlockStored events, keyed as the router computes vLLM's block hashes, so
that it predicts the cached tokens vLLM then reports."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from local_services import free_port, stop_process
from tinymodels import write_tiny_chat_model
from vllm_testkit import GUARD_S, MODEL, Replica, Router, metric_sum, wait_until

from fleetllm.block_hash import chain_hashes, root_hash
from fleetllm.local.launch import LocalModel
from fleetllm.router.kv_feed import FeedSettings
from fleetllm.router.kv_routing import KVRouting

# Read by vLLM's Python: every batch the replay endpoint holds, decoded with vLLM's classes.
DECODE_WITH_VLLM = """
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)
context = zmq.Context()
dealer = context.socket(zmq.DEALER)
dealer.connect(sys.argv[1])
dealer.send_multipart((b"", (0).to_bytes(8, "big")))
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
while True:
    assert dealer.poll(10000), "no replay answer"
    _, topic, seq, payload = dealer.recv_multipart()
    if seq == ZmqEventPublisher.END_SEQ:
        break
    batch = decoder.decode(payload)
    for event in batch.events:
        record = {"type": type(event).__name__, "topic": topic.decode()}
        if isinstance(event, (BlockStored, BlockRemoved)):
            record["hashes"] = [h.hex() for h in event.block_hashes]
            record["medium"] = event.medium
        if isinstance(event, BlockStored):
            record["parent"] = event.parent_block_hash and event.parent_block_hash.hex()
            record["tokens"] = event.token_ids
            record["block_size"] = event.block_size
            record["extra_keys"] = event.extra_keys
        out.append(record)
print(json.dumps(out))
"""


@pytest.fixture
def builtin_engine(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Our engine on a tiny chat model, publishing KV events: (its URL, its replay address)."""
    model = write_tiny_chat_model(tmp_path / "tiny", seed=3)
    with tempfile.TemporaryDirectory(prefix="kv-") as sockets:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{sockets}/events",
            "replay_endpoint": f"ipc://{sockets}/replay",
            "topic": "kv-events",
        }
        port = free_port()
        with (tmp_path / "engine.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleetllm.cli", "engine", "serve", "--model", str(model),
                 "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
                 "--num-kv-blocks", "64", "--num-threads", "1", "--host", "127.0.0.1",
                 "--port", str(port), "--kv-events-config", json.dumps(config)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            try:

                def up() -> bool:
                    assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                    try:
                        return httpx.get(f"{url}/health", timeout=5).status_code == 200
                    except httpx.TransportError:
                        return False

                wait_until(up, "the builtin engine healthy")
                yield url, config["replay_endpoint"]
            finally:
                stop_process(proc)


def test_builtin_engine_events_parse_with_vllms_decoder(
    builtin_engine: tuple[str, str], vllm: Path
) -> None:
    url, replay = builtin_engine
    messages = [{"role": "user", "content": "Tell me about the harbor lantern " * 8}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "cache_salt": "tenant-a"}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=GUARD_S).status_code == 200
    tokens = httpx.post(
        f"{url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=GUARD_S
    ).json()["tokens"]
    expected = [h.hex() for h in chain_hashes(root_hash("tenant-a"), tokens, 16)]

    def decoded() -> list[dict[str, Any]]:
        result = subprocess.run(
            [str(vllm), "-c", DECODE_WITH_VLLM, replay],
            capture_output=True,
            text=True,
            timeout=GUARD_S,
            check=True,
        )
        return json.loads(result.stdout.strip().splitlines()[-1])

    events: list[dict[str, Any]] = []

    def stored_all() -> bool:
        nonlocal events
        events = decoded()
        hashes = [h for e in events if e["type"] == "BlockStored" for h in e["hashes"]]
        return hashes[: len(expected)] == expected

    wait_until(stored_all, "the prompt's blocks stored, read by vLLM's decoder")
    assert events[0]["type"] == "AllBlocksCleared"
    first = next(e for e in events if e["type"] == "BlockStored")
    assert first["topic"] == "kv-events" and first["medium"] == "GPU"
    assert first["parent"] is None and first["block_size"] == 16
    assert first["tokens"] == tokens[: 16 * len(first["hashes"])]
    assert first["extra_keys"][0] == ["tenant-a"]  # msgpack has no tuples


@pytest.mark.asyncio
async def test_the_routers_index_over_vllm_sees_its_blocks_and_predicts_its_cache(
    vllm_replicas: list[Replica], vllm_model: LocalModel, tmp_path: Path
) -> None:
    replica = vllm_replicas[0]
    assert replica.kv_events is not None
    context = zmq.asyncio.Context()
    kv = KVRouting(MODEL, 100_000, 8192, FeedSettings(probe_interval=0.2, stale_after=3.0))
    kv.update(context, {replica.url: replica.kv_events}, vllm_model.plan.model_path)
    # Over two of vLLM's 128-token CPU blocks: only full blocks are cached and reported.
    prompt = "The harbor master keeps a ledger of every lantern and every copper signal. " * 20
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    try:
        start = time.monotonic()
        while kv.prompts is None or not kv.fresh([replica.url]):
            assert time.monotonic() - start < GUARD_S, "vLLM's events not followed"
            await asyncio.sleep(0.1)
        first_view = kv.predict(payload, [replica.url])
        assert first_view is not None and first_view.cached == {replica.url: 0}
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            first = (await client.post(f"{replica.url}/v1/completions", json=payload)).json()
            prompt_tokens = first["usage"]["prompt_tokens"]
            blocks = kv.index.replicas[replica.url]
            while blocks.layout is None or not _cached(kv, payload, replica.url):
                assert time.monotonic() - start < GUARD_S, "vLLM's BlockStored not seen"
                await asyncio.sleep(0.1)
            assert blocks.mismatch is None  # vLLM's hashes, as the router computes them
            block_size = blocks.layout[1]
            predicted = _cached(kv, payload, replica.url)
            assert predicted == (prompt_tokens - 1) // block_size * block_size
            again = (await client.post(f"{replica.url}/v1/completions", json=payload)).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
    finally:
        await kv.stop()
        context.destroy(linger=0)


def test_the_router_routes_vllm_replicas_by_their_events(
    vllm_replicas: list[Replica], vllm_model: LocalModel, tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet.json"
    replicas = [
        {
            "url": r.url,
            "kvEvents": {"endpoint": r.kv_events.events, "replayEndpoint": r.kv_events.replay},
        }
        for r in vllm_replicas
        if r.kv_events is not None
    ]
    doc = {"models": {MODEL: {"tokenizer": vllm_model.plan.model_path, "replicas": replicas}}}
    fleet.write_text(json.dumps(doc))
    router = Router(fleet, tmp_path / "router.log", "--strategy", "kv-aware")
    try:
        # Longer than one of vLLM's 128-token CPU blocks, so that the replicas cache it.
        system = "You answer questions about the harbor ledger, one short sentence each. " * 12
        for i in range(4):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=GUARD_S)
            assert r.status_code == 200
            time.sleep(0.5)  # the events of one request reach the router before the next
        text = router.metrics()
        # The first requests may come before the router follows both replicas (no
        # prediction then); every one predicted is exact, and the later ones hit the cache.
        counted = metric_sum(text, "fleetllm:router_kv_predictions_total")
        exact = metric_sum(text, "fleetllm:router_kv_predictions_total", outcome="exact")
        assert counted >= 2 and exact == counted, text
        assert metric_sum(text, "fleetllm:router_kv_reported_cached_tokens_total") > 0
    finally:
        router.close()


def _cached(kv: KVRouting, payload: dict[str, Any], replica: str) -> int:
    prediction = kv.predict(payload, [replica])
    assert prediction is not None
    return prediction.cached[replica]
