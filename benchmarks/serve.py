"""Online serving benchmark for the engine's OpenAI server, in the manner of `vllm bench serve`.

Sends streamed /v1/completions requests (prompts of random token ids, so input lengths are
exact; ignore_eos, so output lengths are too) at a request rate (Poisson arrivals) and/or
under a concurrency cap, and reports request and token throughput and mean/median/p99 of
TTFT, TPOT and ITL. Datasets: `random`, or `shared-prefix` (every prompt starts with the same
prefix, which exercises the prefix cache).

Against a running server:
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --max-concurrency 8
Or launch one (stopped at the end), sweep concurrencies, and compare each with the offline
engine running the same workload with the same concurrency (the baseline; the ratio is the
HTTP server's efficiency):
    python benchmarks/serve.py --launch --model smollm2-135m --max-concurrency 1 8 32 --baseline

ITL counts every generated token: a chunk that carries k tokens (a client that fell behind
gets them merged) contributes k gaps of a k-th of its delay each.
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
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    lo, hi = args.token_id_range

    def length(mean: int) -> int:
        r = args.range_ratio
        return max(1, rng.randint(int(mean * (1 - r)), int(mean * (1 + r))))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    prefix = tokens(args.prefix_len) if args.dataset == "shared-prefix" else []
    prompts = [prefix + tokens(length(args.input_len)) for _ in range(args.num_prompts)]
    outputs = [length(args.output_len) for _ in range(args.num_prompts)]
    return Workload(prompts, outputs)


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    result = RequestResult(ok=False, input_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    k = len(choice.get("token_ids") or [])
                    if not k:
                        continue
                    now = time.perf_counter()
                    if not result.ttft:
                        result.ttft = now - start
                        k -= 1  # the first token has no inter-token gap
                    if k:
                        result.itls += [(now - last) / k] * k
                    last = now
    except httpx.HTTPError as exc:
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.output_len > 0
    return result


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(max_concurrency or 0, len(workload.prompts)))
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(3600.0), limits=limits, headers=headers
    ) as client:

        async def guarded(prompt: list[int], max_tokens: int) -> RequestResult:
            if limit is None:
                return await one_request(client, model, prompt, max_tokens)
            async with limit:
                return await one_request(client, model, prompt, max_tokens)

        await one_request(client, model, workload.prompts[0][:16], 4)  # warm-up, not counted
        start = time.perf_counter()
        tasks = []
        for prompt, out_len in zip(workload.prompts, workload.output_lens, strict=True):
            tasks.append(asyncio.create_task(guarded(prompt, out_len)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1]
    itls = [gap * 1000 for r in ok for gap in r.itls]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "median": 0.0, "p99": 0.0}
        # Linear interpolation between ranks, as numpy.percentile does.
        p99 = (
            statistics.quantiles(values, n=100, method="inclusive")[98]
            if len(values) > 1
            else values[0]
        )
        return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}

    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats(ttfts),
        "tpot_ms": stats(tpots),
        "itl_ms": stats(itls),
    }


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"{'=' * 12} {title} {'=' * max(0, 36 - len(title))}")
    rows: list[tuple[str, Any]] = [
        ("Successful requests", s["successful_requests"]),
        ("Failed requests", s["failed_requests"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms)",
                         f"{s[key][stat]:.2f}"))  # fmt: skip
    for label, value in rows:
        print(f"{label:<40}{value:>12}")
    for error in s["errors"]:
        print(f"error: {error}")
    sys.stdout.flush()  # results of a long sweep show up as each run ends


def run_offline(args: argparse.Namespace, workload: Workload, concurrency: int | None) -> float:
    """Output tokens/s of the offline engine on the same workload and concurrency."""
    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=concurrency or 128,
        num_threads=args.num_threads,
    )
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
              for n in workload.output_lens]  # fmt: skip
    llm.generate(workload.prompts[0][:16], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    duration = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / duration


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fleetllm.cli", "engine", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--log-level", "warning"]  # fmt: skip
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return proc, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--launch", action="store_true", help="start a server for the run")
    ap.add_argument(
        "--model", default=None, help="served model name; with --launch, the model to serve"
    )
    ap.add_argument("--dtype", default="auto", help="with --launch (and --baseline)")
    ap.add_argument("--max-model-len", type=int, default=None, help="with --launch")
    ap.add_argument("--num-threads", type=int, default=None, help="with --launch")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the launched server (repeatable)")  # fmt: skip
    ap.add_argument("--api-key", default=os.environ.get("FLEETLLM_API_KEY"))
    ap.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    ap.add_argument("--prefix-len", type=int, default=256, help="shared-prefix dataset")
    ap.add_argument("--token-id-range", type=int, nargs=2, default=[1000, 20000])
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s, Poisson arrivals (default: all at once)")  # fmt: skip
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                    help="cap on requests in flight; several values run a sweep")  # fmt: skip
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also run the offline engine on the same workload (needs --launch)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json", default=None, help="write all results here")
    args = ap.parse_args()
    if args.baseline and not args.launch:
        ap.error("--baseline needs --launch (it must know the model)")
    if args.launch and args.model is None:
        args.model = "smollm2-135m"

    workload = make_workload(args)
    proc = None
    if args.launch:
        proc, args.base_url = launch_server(args)
    try:
        model = args.model
        if model is None:
            models = httpx.get(f"{args.base_url}/v1/models", timeout=30).json()
            model = models["data"][0]["id"]
        runs = []
        for concurrency in args.max_concurrency:
            results, duration = asyncio.run(
                run_load(args.base_url, model, workload, args.request_rate, concurrency,
                         args.api_key, args.seed)
            )  # fmt: skip
            summary = summarize(results, duration)
            summary["max_concurrency"] = concurrency
            summary["request_rate"] = args.request_rate
            runs.append(summary)
            print_summary(f"Serving Benchmark Result (max concurrency {concurrency})", summary)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    if args.baseline:
        print(f"{'=' * 12} Baseline: offline engine, same workload {'=' * 8}")
        for run in runs:
            offline = run_offline(args, workload, run["max_concurrency"])
            run["offline_output_throughput"] = offline
            ratio = run["output_throughput"] / offline
            print(f"max concurrency {run['max_concurrency']}: server "
                  f"{run['output_throughput']:.1f} tok/s, offline {offline:.1f} tok/s, "
                  f"ratio {ratio:.2f}")  # fmt: skip
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "workload": asdict(workload) | {"prompts": None},
                       "runs": runs}, f, indent=2, default=str)  # fmt: skip
    return 0 if all(r["failed_requests"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
