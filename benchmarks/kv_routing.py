"""kv-aware routing against the other strategies, on a workload that evicts.

R builtin replicas (SmolLM2-135M) with small KV pools serve multi-turn conversations over P
shared system prompts: each conversation sends its turns one after another (the history
grows), and C conversations run at once. The working set (every system prompt and the
histories) is larger than the replicas' pools together hold, so replicas evict, and which
replica a turn lands on decides what it finds cached. One router per strategy (kv-aware,
prefix, least-load, round-robin) serves the same workload shape over the same replicas, each
with its own system prompts so that none inherits another's cache. With --preamble-words,
every system prompt begins with one shared preamble (a company's rules before each assistant's
own instructions), longer than the characters the prefix hash reads. Printed per strategy:
the prefix-cache hit rate (the engines' token counters over the run), mean/median/p99 time
to first token, how the load spread (requests per replica; how far the busiest replica's
in-flight count went past load_factor x the mean, sampled from the router), the ceiling (the
hit rate of one cache that never evicts, over the same requests: what no routing passes), and
for kv-aware how its predicted cached tokens matched what the engines reported. First, what a
request's tokens cost the router: tokenizing and hashing in the router (what kv-aware does)
against asking a replica's /tokenize (a round trip), for chat prompts of several lengths.
The machine's load average is printed with the figures (the machine may be shared).

    python benchmarks/kv_routing.py                  # 4 replicas, 24 prompts
    python benchmarks/kv_routing.py --replicas 3 --prompts 20 --conversations 2 --turns 3
    python benchmarks/kv_routing.py --preamble-words 100   # every system prompt after one preamble
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router import (
    WORDS,
    Proc,
    engine_args,
    percentile,
    prefix_cache,
    processes,
    wait_healthy,
)

if TYPE_CHECKING:
    from fleetllm.router.prompt_tokens import PromptTokenizer

STRATEGIES = ("kv-aware", "prefix", "least-load", "round-robin")


def system_prompt(rng: random.Random, index: int, words: int, preamble: str = "") -> str:
    return (
        preamble
        + f"You are assistant {index} of the harbor office. Context: "
        + " ".join(rng.choice(WORDS) for _ in range(words))
    )


async def chat_turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """(TTFT in seconds, the reply) for one streamed chat turn."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": True}
    # With the usage at the stream's end, the router checks its prediction of cached tokens.
    body["stream_options"] = {"include_usage": True}
    body["temperature"] = 0
    start = time.perf_counter()
    ttft = 0.0
    text: list[str] = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:
                continue  # the usage event
            delta = choices[0]["delta"].get("content") or ""
            if delta and not ttft:
                ttft = time.perf_counter() - start
            text.append(delta)
    return ttft or time.perf_counter() - start, "".join(text)


async def inflight_sampler(
    session: aiohttp.ClientSession, url: str, samples: list[list[float]], stop: asyncio.Event
) -> None:
    """The router's in-flight count per replica, every 50 ms."""
    while not stop.is_set():
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        loads = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("fleetllm:router_inflight{")
        ]
        if loads:
            samples.append(loads)
        await asyncio.sleep(0.05)


def spread(samples: list[list[float]], load_factor: float, replicas: int) -> dict[str, Any]:
    """How far the busiest replica went past the bound, over samples with some load."""
    over = 0
    worst = 0.0
    busy = [s for s in samples if sum(s) >= replicas]
    for loads in busy:
        bound = math.ceil(load_factor * sum(loads) / replicas)
        over += max(loads) > bound
        worst = max(worst, max(loads) / (sum(loads) / replicas))
    return {
        "samples": len(busy),
        "within_bound": round(1 - over / len(busy), 3) if busy else None,
        "peak_over_mean": round(worst, 2),
    }


async def router_metric(
    session: aiohttp.ClientSession, url: str, name: str, **labels: str
) -> float:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def served(session: aiohttp.ClientSession, engines: list[Proc]) -> list[float]:
    counts = []
    for e in engines:
        async with session.get(f"{e.url}/metrics") as r:
            text = await r.text()
        counts.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
        )
    return counts


def ceiling_hit_rate(prompts: PromptTokenizer, sent: list[list[dict[str, str]]]) -> float:
    """The hit rate of one cache that never evicts, over the requests in the order they were
    sent: what no routing can pass. Each request finds the whole blocks (16 tokens, all but
    its last token, as the engines count) that an earlier request already had."""
    from fleetllm.block_hash import chain_hashes, root_hash

    seen: set[bytes] = set()
    hits = queries = 0
    for messages in sent:
        tokens = prompts.tokens({"messages": messages}) or []
        keys = chain_hashes(root_hash(None), tokens[:-1], 16)
        held = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
        hits += held * 16
        queries += len(tokens)
        seen.update(keys)
    return hits / queries if queries else 0.0


async def run_strategy(
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
    engines: list[Proc],
    url: str,
    index: int,
    prompts: PromptTokenizer,
) -> dict[str, Any]:
    rng = random.Random(1000 + index)
    preamble = ""
    if args.preamble_words:
        preamble = "Rules of the office. " + " ".join(
            rng.choice(WORDS) for _ in range(args.preamble_words)
        )
        preamble += "\n"
    systems = [system_prompt(rng, i, args.prompt_words, preamble) for i in range(args.prompts)]
    conversations = [(p, c) for p in range(args.prompts) for c in range(args.conversations)]
    rng.shuffle(conversations)
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    sent: list[list[dict[str, str]]] = []

    async def converse(prompt: int, conv: int) -> None:
        talk = random.Random(prompt * 1000 + conv)
        messages = [{"role": "system", "content": systems[prompt]}]
        async with gate:
            for turn in range(args.turns):
                question = " ".join(talk.choice(WORDS) for _ in range(args.question_words))
                messages.append({"role": "user", "content": f"Question {turn}: {question}?"})
                sent.append(list(messages))
                ttft, reply = await chat_turn(session, url, messages, args.max_tokens)
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": reply})

    before_cache = await prefix_cache(session, engines)
    before_served = await served(session, engines)
    samples: list[list[float]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(inflight_sampler(session, url, samples, stop))
    started = time.perf_counter()
    await asyncio.gather(*(converse(p, c) for p, c in conversations))
    wall = time.perf_counter() - started
    stop.set()
    await sampler
    after_cache = await prefix_cache(session, engines)
    after_served = await served(session, engines)
    queries = after_cache[0] - before_cache[0]
    result: dict[str, Any] = {
        "requests": len(ttfts),
        "prefix_cache_hit_rate": round((after_cache[1] - before_cache[1]) / queries, 3),
        "mean_ttft_ms": round(statistics.fmean(ttfts) * 1000, 1),
        "median_ttft_ms": round(statistics.median(ttfts) * 1000, 1),
        "p99_ttft_ms": round(percentile(ttfts, 99) * 1000, 1),
        "requests_per_replica": [
            int(a - b) for a, b in zip(after_served, before_served, strict=True)
        ],
        "load": spread(samples, args.load_factor, len(engines)),
        "wall_s": round(wall, 1),
        "ceiling_hit_rate": round(ceiling_hit_rate(prompts, sent), 3),
    }
    predicted = await router_metric(session, url, "fleetllm:router_kv_predictions_total")
    if predicted:
        exact = await router_metric(
            session, url, "fleetllm:router_kv_predictions_total", outcome="exact"
        )
        result["predictions_exact"] = f"{int(exact)}/{int(predicted)}"
    return result


async def tokenize_cost(
    session: aiohttp.ClientSession, engine: Proc, prompts: PromptTokenizer
) -> dict[str, Any]:
    """Median ms per request: the router's own tokenization and block keys, and a replica's
    /tokenize for the same messages."""
    from fleetllm.block_hash import chain_hashes, root_hash

    rng = random.Random(7)
    out: dict[str, Any] = {}
    for words in (100, 1000, 4000):
        messages = [
            {"role": "system", "content": system_prompt(rng, 0, words)},
            {"role": "user", "content": "What comes next?"},
        ]
        local, remote = [], []
        tokens: list[int] = []
        for _ in range(20):
            start = time.perf_counter()
            tokens = prompts.tokens({"messages": messages}) or []
            chain_hashes(root_hash("tenant"), tokens, 16)
            local.append(time.perf_counter() - start)
            start = time.perf_counter()
            async with session.post(
                f"{engine.url}/tokenize", json={"model": "bench", "messages": messages}
            ) as r:
                assert (await r.json())["tokens"] == tokens
            remote.append(time.perf_counter() - start)
        out[f"{len(tokens)}_tokens"] = {
            "router_ms": round(statistics.median(local) * 1000, 2),
            "replica_tokenize_ms": round(statistics.median(remote) * 1000, 2),
        }
    return out


async def main_async(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from fleetllm.engine.model_files import resolve_model

    model_dir = resolve_model(args.model)
    with processes() as procs, tempfile.TemporaryDirectory(prefix="kvb-") as sockets:
        engines = []
        replicas = []
        for i in range(args.replicas):
            events = {"endpoint": f"ipc://{sockets}/{i}-events",
                      "replayEndpoint": f"ipc://{sockets}/{i}-replay"}  # fmt: skip
            config = {"enable_kv_cache_events": True, "endpoint": events["endpoint"],
                      "replay_endpoint": events["replayEndpoint"]}  # fmt: skip
            extra = ["--num-kv-blocks", str(args.num_kv_blocks),
                     "--kv-events-config", json.dumps(config)]  # fmt: skip
            engine = Proc(engine_args(args, args.model, *extra), workdir / f"engine-{i}.log")
            engines.append(engine)
            replicas.append({"url": engine.url, "kvEvents": events})
        procs.extend(engines)
        fleet = workdir / "fleet.json"
        models = {"bench": {"tokenizer": str(model_dir), "replicas": replicas}}
        fleet.write_text(json.dumps({"models": models}))
        routers = {
            s: Proc(["router", "serve", "--fleet-file", str(fleet), "--strategy", s,
                     "--load-factor", str(args.load_factor), "--no-request-log"],
                    workdir / f"router-{s}.log")
            for s in STRATEGIES
        }  # fmt: skip
        procs.extend(routers.values())
        await wait_healthy([*engines, *routers.values()])
        await asyncio.sleep(3)  # the kv-aware router follows every replica's events
        result: dict[str, Any] = {
            "replicas": args.replicas,
            "kv_blocks_per_replica": args.num_kv_blocks,
            "prompts": args.prompts,
            "preamble_words": args.preamble_words,
            "conversations_per_prompt": args.conversations,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "load_factor": args.load_factor,
        }
        timeout = aiohttp.ClientTimeout(total=3600)
        from fleetllm.router.prompt_tokens import PromptTokenizer

        prompts = PromptTokenizer.load(model_dir, max_tokens=1 << 15)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            result["tokenize_cost"] = await tokenize_cost(session, engines[0], prompts)
            print(json.dumps({"tokenize_cost": result["tokenize_cost"]}), flush=True)
            for index, strategy in enumerate(STRATEGIES):
                load = os.getloadavg()
                result[strategy] = await run_strategy(
                    args, session, engines, routers[strategy].url, index, prompts
                )
                result[strategy]["loadavg_before"] = [round(x, 1) for x in load]
                print(json.dumps({strategy: result[strategy]}), flush=True)
        kv, prefix = result["kv-aware"], result["prefix"]
        result["hit_rate_points_over_prefix"] = round(
            100 * (kv["prefix_cache_hit_rate"] - prefix["prefix_cache_hit_rate"]), 1
        )
        for other in STRATEGIES[1:]:
            result[f"{other}_ttft_over_kv_aware"] = round(
                result[other]["mean_ttft_ms"] / kv["mean_ttft_ms"], 2
            )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=160, help="per replica, 16 tokens each")
    p.add_argument("--prompts", type=int, default=24, help="shared system prompts")
    p.add_argument("--prompt-words", type=int, default=300, help="about 1 token per word")
    p.add_argument(
        "--preamble-words",
        type=int,
        default=0,
        help="a preamble every system prompt begins with (longer than the prefix hash reads"
        " from about 45 words)",
    )
    p.add_argument("--conversations", type=int, default=2, help="per system prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--question-words", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    p.add_argument("--load-factor", type=float, default=1.25)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        result = asyncio.run(main_async(args, Path(tmp)))
    print(json.dumps({"kv_routing": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
