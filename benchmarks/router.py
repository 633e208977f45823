"""Router benchmark: what the router costs, and what prefix-aware routing buys.

Part 1, added latency: one engine replica; N closed-loop clients (64 by default) stream
completions through `fleetllm router serve` while N others stream straight to the same
engine at the same time, so both paths ride the same engine batches. Reports p50/p99 of time
to first token (TTFT) and of end-to-end latency per path, and the router's added latency
(router minus direct). With `--strategy kv-aware` the replica (the engine, or the stub with
a publisher of its own) publishes KV events and the router follows them, tokenizing and
looking up every prompt.

Part 2, shared-prefix TTFT over 4 replicas: P long system prompts, each asked R times in a
shuffled order under a concurrency cap, routed by `prefix`, `least-load` and `round-robin` in
turn (one router per strategy over the same replicas; each strategy gets its own fresh
prompts, so none inherits another's cached prefixes). Each replica's KV cache holds fewer
prefixes than the whole set but more than its share under prefix routing: the situation
prefix routing is for. Reports mean/median TTFT per strategy and round-robin / prefix.

    python benchmarks/router.py                       # both parts, SmolLM2-135M
    python benchmarks/router.py --part latency --streams 64 --requests-per-client 3
    python benchmarks/router.py --part latency --strategy kv-aware
    python benchmarks/router.py --part latency --latency-upstream stub --strategy kv-aware
    python benchmarks/router.py --part prefix --prompts 24 --requests-per-prompt 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STARTUP_GUARD_S = 300.0
# fmt: off
WORDS = [
    "river", "stone", "market", "signal", "harbor", "lantern", "copper", "orchard", "meadow",
    "engine", "quiet", "ledger", "canvas", "ember", "falcon", "glacier", "timber", "velvet",
    "summit", "archive", "beacon", "cipher", "delta", "fjord", "granite", "horizon", "island",
    "jasmine", "kernel", "lagoon", "mosaic", "nectar", "oasis", "prism", "quartz",
]
# fmt: on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, args: list[str], log: Path, program: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*(program or [sys.executable, "-m", "fleetllm.cli"]), *args,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def wait_healthy(procs: list[Proc]) -> None:
    deadline = time.monotonic() + STARTUP_GUARD_S
    async with aiohttp.ClientSession() as session:
        for p in procs:
            while True:
                if p.proc.poll() is not None:
                    # Its last words: the logs live in a directory removed on the way out.
                    tail = p.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                    raise RuntimeError(
                        f"{p.url} exited with {p.proc.returncode}:\n" + "\n".join(tail)
                    )
                try:
                    async with session.get(f"{p.url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.url} not healthy in {STARTUP_GUARD_S}s")
                await asyncio.sleep(0.1)


@contextmanager
def processes() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


def engine_args(args: argparse.Namespace, model: str, *extra: str) -> list[str]:
    return [
        "engine", "serve", "--model", model, "--served-model-name", "bench",
        "--max-model-len", "2048", "--num-threads", str(args.engine_threads), *extra,
    ]  # fmt: skip


async def stream_once(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float]:
    """(TTFT, end-to-end) in seconds for one streamed completion."""
    start = time.perf_counter()
    ttft = 0.0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        tail = b""
        async for chunk in r.content.iter_any():
            if not ttft and b"data: {" in chunk:
                ttft = time.perf_counter() - start
            tail = (tail + chunk)[-64:]
        if not tail.endswith(b"data: [DONE]\n\n") or b'"error"' in tail:
            raise RuntimeError("stream did not end cleanly")
    return ttft, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- part 1 ----------------------------------------------------------------------------------


def serve_stub(argv: list[str]) -> None:
    """A constant-time stand-in for a replica: every stream sends one event per interval (a
    GPU-like decode step). It has no variance of its own, so what differs between the
    direct and the routed streams is the router's delay alone."""
    from aiohttp import web

    p = argparse.ArgumentParser()
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--kv-events-config", default=None, help="publish (no) KV events here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    if a.kv_events_config:
        # A publisher that answers the router's checks: the stub holds no blocks.
        from fleetllm.engine.kv_publisher import KVEventPublisher
        from fleetllm.kv_events import parse_kv_events_config

        KVEventPublisher(parse_kv_events_config(a.kv_events_config))
    event = (
        b'data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"bench",'
        b'"choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null}]}\n\n'
    )

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return web.Response(text="")
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body.get("max_tokens", 16)):
            await asyncio.sleep(a.interval)
            await response.write(event)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None)


async def latency_part(args: argparse.Namespace, workdir: Path, stub: bool) -> dict[str, Any]:
    """N closed-loop clients stream through the router while N others stream straight to the
    same upstream, all at once: both paths ride the same engine batches on the same machine,
    so the difference between them is the router's delay. Each client's first request
    (connection set-up, cold caches) is not counted."""
    with processes() as procs:
        events = kv_events(workdir / ("stub" if stub else "engine"))
        extra = ["--kv-events-config", json.dumps(events[0])] if args.strategy == "kv-aware" else []
        if stub:
            program = [sys.executable, str(Path(__file__).resolve()), "--serve-stub"]
            stub_args = ["--interval", str(args.stub_interval), *extra]
            engine = Proc(stub_args, workdir / "stub.log", program)
        else:
            engine_log = workdir / "latency-engine.log"
            engine = Proc(engine_args(args, args.latency_model, *extra), engine_log)
        procs.append(engine)
        fleet = workdir / "latency-fleet.json"
        replica: dict[str, Any] = {"url": engine.url}
        model: dict[str, Any] = {"replicas": [replica]}
        if extra:
            from fleetllm.engine.model_files import resolve_model

            replica["kvEvents"] = events[1]
            model["tokenizer"] = str(resolve_model(args.latency_model))
        fleet.write_text(json.dumps({"models": {"bench": model}}))
        router = Proc(
            ["router", "serve", "--fleet-file", str(fleet), "--strategy", args.strategy],
            workdir / "router.log",
        )
        procs.append(router)
        await wait_healthy([engine, router])
        if extra:
            await asyncio.sleep(3)  # the router follows the replica's events

        samples: dict[str, dict[str, list[float]]] = {
            "direct": {"ttft": [], "e2e": []},
            "router": {"ttft": [], "e2e": []},
        }
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=1800)
        rng = random.Random(0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def client(path: str, worker: int, stagger: float) -> None:
                await asyncio.sleep(stagger)
                url = engine.url if path == "direct" else router.url
                for i in range(args.requests_per_client + 1):
                    body = {
                        "model": "bench",
                        "prompt": f"Client {path}-{worker} request {i}: the weather in port is",
                        "max_tokens": args.max_tokens,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    ttft, e2e = await stream_once(session, url, body)
                    if i:
                        samples[path]["ttft"].append(ttft)
                        samples[path]["e2e"].append(e2e)

            await asyncio.gather(*(
                client(path, w, rng.uniform(0, args.stagger))
                for path in ("direct", "router")
                for w in range(args.streams)
            ))  # fmt: skip
    result: dict[str, Any] = {
        "upstream": f"stub, one event per {args.stub_interval}s" if stub else args.latency_model,
        "strategy": args.strategy,
        "loadavg": [round(x, 1) for x in os.getloadavg()],
        "streams_per_path": args.streams,
        "requests_per_path": len(samples["router"]["ttft"]),
    }
    for metric in ("ttft", "e2e"):
        for q in (50, 99):
            d = percentile(samples["direct"][metric], q)
            v = percentile(samples["router"][metric], q)
            result[f"{metric}_p{q}_direct_ms"] = round(d * 1000, 2)
            result[f"{metric}_p{q}_router_ms"] = round(v * 1000, 2)
            result[f"{metric}_p{q}_added_ms"] = round((v - d) * 1000, 2)
    return result


def kv_events(base: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A replica's --kv-events-config on Unix sockets, and the fleet file's `kvEvents`."""
    base.mkdir(parents=True, exist_ok=True)
    endpoint, replay = f"ipc://{base}/events", f"ipc://{base}/replay"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    return config, {"endpoint": endpoint, "replayEndpoint": replay}


# -- part 2 ----------------------------------------------------------------------------------


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are a helpful assistant. Context: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


async def prefix_cache(session: aiohttp.ClientSession, engines: list[Proc]) -> tuple[float, float]:
    """Prompt tokens looked up in the engines' prefix caches, and of those found, summed."""
    queries = hits = 0.0
    for e in engines:
        async with session.get(f"{e.url}/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def prefix_part(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    strategies = ("prefix", "least-load", "round-robin")
    with processes() as procs:
        engines = [
            Proc(
                engine_args(args, args.model, "--num-kv-blocks", str(args.num_kv_blocks)),
                workdir / f"engine-{i}.log",
            )
            for i in range(args.replicas)
        ]
        procs.extend(engines)
        fleet = workdir / "prefix-fleet.json"
        fleet.write_text(json.dumps({"models": {"bench": [e.url for e in engines]}}))
        routers = {
            s: Proc(["router", "serve", "--fleet-file", str(fleet), "--strategy", s,
                     "--no-request-log"], workdir / f"router-{s}.log")
            for s in strategies
        }  # fmt: skip
        procs.extend(routers.values())
        await wait_healthy([*engines, *routers.values()])

        result: dict[str, Any] = {
            "replicas": args.replicas,
            "prompts": args.prompts,
            "requests_per_prompt": args.requests_per_prompt,
            "concurrency": args.concurrency,
        }
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(
                f"{engines[0].url}/tokenize",
                json={"prompt": system_prompt(random.Random(0), args.prompt_words)},
            ) as r:
                result["system_prompt_tokens"] = (await r.json())["count"]
            for index, strategy in enumerate(strategies):
                rng = random.Random(1000 + index)
                prompts = [system_prompt(rng, args.prompt_words) for _ in range(args.prompts)]
                jobs = [
                    (p, j) for p in range(args.prompts) for j in range(args.requests_per_prompt)
                ]
                rng.shuffle(jobs)
                gate = asyncio.Semaphore(args.concurrency)

                async def run(
                    job: tuple[int, int],
                    prompts: list[str] = prompts,
                    gate: asyncio.Semaphore = gate,
                    url: str = routers[strategy].url,
                ) -> float:
                    p, j = job
                    body = {
                        "model": "bench",
                        "prompt": f"{prompts[p]}\nQuestion {j}: what comes next?",
                        "max_tokens": 2,
                        "stream": True,
                    }
                    async with gate:
                        ttft, _ = await stream_once(session, url, body)
                    return ttft

                cache_before = await prefix_cache(session, engines)
                started = time.perf_counter()
                ttfts = await asyncio.gather(*(run(job) for job in jobs))
                wall = time.perf_counter() - started
                cache_after = await prefix_cache(session, engines)
                queries = cache_after[0] - cache_before[0]
                result[strategy] = {
                    "mean_ttft_ms": round(statistics.fmean(ttfts) * 1000, 1),
                    "median_ttft_ms": round(statistics.median(ttfts) * 1000, 1),
                    "p99_ttft_ms": round(percentile(ttfts, 99) * 1000, 1),
                    "prefix_cache_hit_rate": round(
                        (cache_after[1] - cache_before[1]) / queries if queries else 0.0, 3
                    ),
                    "wall_s": round(wall, 1),
                }
        result["round_robin_over_prefix"] = round(
            result["round-robin"]["mean_ttft_ms"] / result["prefix"]["mean_ttft_ms"], 2
        )
        result["least_load_over_prefix"] = round(
            result["least-load"]["mean_ttft_ms"] / result["prefix"]["mean_ttft_ms"], 2
        )
    return result


def main() -> int:
    if sys.argv[1:2] == ["--serve-stub"]:
        serve_stub(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "latency", "prefix"), default="all")
    p.add_argument("--model", default="smollm2-135m", help="model of the prefix part")
    p.add_argument("--latency-model", default="smollm2-135m", help="model of the latency part")
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument(
        "--strategy", default="prefix", help="latency part: the router's strategy (default prefix)"
    )
    p.add_argument(
        "--latency-upstream",
        choices=("both", "engine", "stub"),
        default="both",
        help="latency part: behind the router, a real engine, the constant-time stub, or both",
    )
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--stagger", type=float, default=2.0, help="seconds over which clients start")
    p.add_argument("--max-tokens", type=int, default=32, help="latency part: tokens per stream")
    p.add_argument(
        "--stub-interval",
        type=float,
        default=0.02,
        help="latency part, stub upstream: seconds between events",
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--requests-per-prompt", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=800, help="about 1 token per word")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=512,
        help="per replica (16 tokens each): fewer prefixes than the whole set",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        workdir = Path(tmp)
        report: dict[str, Any] = {}
        if args.part in ("all", "latency"):
            upstreams = (("added_latency_engine", False), ("added_latency_stub", True))
            for name, stub in upstreams:
                if args.latency_upstream not in ("both", "stub" if stub else "engine"):
                    continue
                report[name] = asyncio.run(latency_part(args, workdir, stub))
                print(json.dumps({name: report[name]}, indent=2), flush=True)
        if args.part in ("all", "prefix"):
            report["shared_prefix_ttft"] = asyncio.run(prefix_part(args, workdir))
            print(json.dumps({"shared_prefix_ttft": report["shared_prefix_ttft"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
