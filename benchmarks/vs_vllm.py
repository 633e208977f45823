"""fleetllm's engine against vLLM's CPU build: the same workload, the same model, one run.

Each server runs alone on the machine, one after the other: fleetllm's engine (`fleetllm
engine serve`, on all cores, its own defaults), vLLM at its default CPU binding (one core
reserved for its API process, the others compute), vLLM computing on all cores, and vLLM on all
cores with fleetllm's step token budget on a CPU (`--max-num-batched-tokens 512`; vLLM's own
is 2048), so that what the budget alone does is vLLM's too. The workload is streamed
/v1/completions with prompts of random token ids (32..256 tokens) and outputs of 16..128
tokens with ignore_eos, at each concurrency asked for (1, 32 and 64 by default). Every server
is measured `--rounds` times, the rounds interleaved (the order rotates), because these small
machines are noisy: the ratios printed are medians over rounds with their spread. Each ratio
is against vLLM's best configuration for that figure in the round, per concurrency: its most
tokens per second, its lowest mean TTFT, its lowest p99 TPOT (which may be three different
configurations).

Cold start is spawn to the first streamed token of a first request (sent as soon as /health
answers 200), the time a scaled-from-zero replica makes its first client wait.

    python benchmarks/vs_vllm.py [--rounds 3] [--concurrency 1 32 64] [--dtype auto]

vLLM runs with the Python of `$FLEETLLM_VLLM_PYTHON`, else `.venv-vllm/bin/python`
(`FLEETLLM_WITH_VLLM=1 scripts/setup.sh` installs it). The CPU flags, the instruction-set
caps set in the environment (ONEDNN_MAX_CPU_ISA and the like: set them to measure as on an
AVX2-only CPU; both servers inherit them) and the load average are printed with the figures.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import RequestResult, Workload, one_request, run_load, summarize

from fleetllm.engine import cpu_features, sizing
from fleetllm.engine.model_files import resolve_model
from fleetllm.local.vllm import find_vllm_python

MODEL_NAME = "smollm2-135m"
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@dataclass(frozen=True)
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]


@dataclass
class Measured:
    cold_start_s: float
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    """concurrency -> serve.summarize()"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def servers(args: argparse.Namespace, model_dir: Path, port: int) -> list[Server]:
    cores = os.cpu_count() or 1
    common = ["--max-model-len", str(args.max_model_len), "--port", str(port)]
    common += ["--host", "127.0.0.1", "--served-model-name", MODEL_NAME]
    base_env = dict(os.environ)
    ours = Server(
        "fleetllm",
        [sys.executable, "-m", "fleetllm.cli", "engine", "serve", "--model", str(model_dir),
         "--dtype", args.dtype, "--num-threads", str(cores), "--log-level", "warning",
         "--max-num-seqs", str(max(args.concurrency)), *common],
        base_env,
    )  # fmt: skip
    vllm_python = find_vllm_python()
    if vllm_python is None:
        raise SystemExit(
            "vs_vllm: vLLM's CPU build is not installed; run FLEETLLM_WITH_VLLM=1 "
            "scripts/setup.sh (or set FLEETLLM_VLLM_PYTHON)"
        )
    # vLLM's dtype auto is the checkpoint's (float32 here): give it the engine's own choice.
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cpu_features.native_bf16() else "float32"
    vllm_argv = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(model_dir), "--dtype", dtype,
                 "--max-num-seqs", str(max(args.concurrency)),
                 *common]  # fmt: skip
    vllm_env = base_env | {
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    all_cores = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    budget = sizing.CPU_MAX_NUM_BATCHED_TOKENS
    return [
        ours,
        Server("vllm-default", vllm_argv, vllm_env),
        Server(f"vllm-{cores}-threads", vllm_argv, vllm_env | all_cores),
        Server(
            f"vllm-{cores}-threads-b{budget}",
            [*vllm_argv, "--max-num-batched-tokens", str(budget)],
            vllm_env | all_cores,
        ),
    ]


def make_workload(n: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    return Workload(prompts, [rng.randint(16, 128) for _ in range(n)])


async def first_token_after(base_url: str, deadline: float) -> float:
    """Polls /health until it answers 200, then streams one request; the clock time of its
    first token."""
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0)) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get("/health", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        else:
            raise SystemExit(f"{base_url} did not become healthy")
        sent = time.monotonic()
        result: RequestResult = await one_request(client, MODEL_NAME, list(range(1000, 1016)), 4)
        if not result.ok:
            raise SystemExit(f"{base_url}: the first request failed: {result.error}")
        return sent + result.ttft


def measure(server: Server, args: argparse.Namespace, port: int) -> Measured:
    log = open(args.log_dir / f"{server.name}.log", "ab")  # noqa: SIM115
    spawned = time.monotonic()
    proc = subprocess.Popen(server.argv, env=server.env, stdout=log, stderr=log)
    try:
        first = asyncio.run(first_token_after(f"http://127.0.0.1:{port}", spawned + 900))
        measured = Measured(cold_start_s=first - spawned)
        for concurrency in args.concurrency:
            workload = make_workload(max(8, 2 * concurrency), args.seed + concurrency)
            results, duration = asyncio.run(
                run_load(f"http://127.0.0.1:{port}", MODEL_NAME, workload, float("inf"),
                         concurrency, None, args.seed)
            )  # fmt: skip
            summary = summarize(results, duration)
            if summary["failed_requests"]:
                raise SystemExit(f"{server.name}: failed requests: {summary['errors']}")
            measured.runs[concurrency] = summary
            print(
                f"  {server.name:<18} c={concurrency:<3} {summary['output_throughput']:8.1f} tok/s"
                f"  TTFT mean {summary['ttft_ms']['mean']:7.1f} ms p99 "
                f"{summary['ttft_ms']['p99']:7.1f}  TPOT mean {summary['tpot_ms']['mean']:6.1f}"
                f" p99 {summary['tpot_ms']['p99']:6.1f} ms",
                flush=True,
            )
        return measured
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def _best_vllm(
    measured: dict[str, Measured], c: int, figure: Any, lowest: bool
) -> tuple[str, float]:
    """vLLM's configuration with the best value of `figure` at concurrency c, and the value."""
    values = {n: figure(m.runs[c]) for n, m in measured.items() if n.startswith("vllm")}
    name = (min if lowest else max)(values, key=lambda n: values[n])
    return name, values[name]


# (name, the figure from a run's summary, whether lower is better)
FIGURES = (
    ("tok/s", lambda run: run["output_throughput"], False),
    ("mean TTFT", lambda run: run["ttft_ms"]["mean"], True),
    ("p99 TPOT", lambda run: run["tpot_ms"]["p99"], True),
)


def report(rounds: list[dict[str, Measured]], concurrency: list[int]) -> dict[str, Any]:
    """Per concurrency and figure: ours over vLLM's best configuration for that figure in each
    round, and the ratios' median."""
    table: dict[str, Any] = {}
    print("\n=== fleetllm / vLLM's best for each figure (median over rounds, spread min-max) ===")
    for c in concurrency:
        table[str(c)] = {"fleetllm": [m["fleetllm"].runs[c] for m in rounds]}
        for label, figure, lowest in FIGURES:
            ratios, ours, theirs, winners = [], [], [], []
            for measured in rounds:
                name, best = _best_vllm(measured, c, figure, lowest)
                mine = figure(measured["fleetllm"].runs[c])
                ratios.append(mine / best)
                ours.append(mine)
                theirs.append(best)
                winners.append(name)
            print(f"c={c:<3} {label:<10} fleetllm {statistics.median(ours):9.1f}  vLLM "
                  f"{statistics.median(theirs):9.1f} ({', '.join(winners)})  "
                  f"ratio {median_spread(ratios)}")  # fmt: skip
            table[str(c)][label] = {"ratio": ratios, "fleetllm": ours, "vllm": theirs,
                                    "vllm_config": winners}  # fmt: skip
    ours_cold = [m["fleetllm"].cold_start_s for m in rounds]
    theirs_cold = [
        min(s.cold_start_s for n, s in m.items() if n.startswith("vllm")) for m in rounds
    ]
    cold = [o / t for o, t in zip(ours_cold, theirs_cold, strict=True)]
    print(f"cold start (spawn to first token): fleetllm {statistics.median(ours_cold):.1f} s, "
          f"vLLM {statistics.median(theirs_cold):.1f} s, ratio {median_spread(cold)}")  # fmt: skip
    table["cold_start_s"] = {"fleetllm": ours_cold, "vllm": theirs_cold}
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--dtype", default="auto", help="both servers (auto: the engine's choice)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=Path("vs_vllm_logs"))
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    model_dir = resolve_model(MODEL_NAME)
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if name in os.environ]
    print(f"cpu flags      : {cpu_features.describe()}")
    print(f"isa caps       : {' '.join(caps) or 'none'}")
    print(f"cores          : {os.cpu_count()}; load average {os.getloadavg()}")
    print(f"model          : {model_dir}; dtype {args.dtype}")
    port = free_port()
    candidates = servers(args, model_dir, port)
    rounds: list[dict[str, Measured]] = []
    for index in range(args.rounds):
        order = candidates[index % len(candidates) :] + candidates[: index % len(candidates)]
        print(f"round {index + 1}/{args.rounds}: {', '.join(s.name for s in order)}", flush=True)
        measured = {}
        for server in order:
            measured[server.name] = measure(server, args, port)
            print(f"  {server.name:<18} cold start {measured[server.name].cold_start_s:.1f} s")
        rounds.append(measured)
    table = report(rounds, args.concurrency)
    print(f"load average at the end: {os.getloadavg()}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(table, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
