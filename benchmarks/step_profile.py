"""Where a decode step's time goes, in fleetllm's engine and in vLLM's CPU build, on this CPU.

Both engines run in this machine's Python processes without a server (vLLM's engine core
in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), on the same model, dtype and threads, with the
same batch: random-token prompts of 32..256 tokens, greedy, ignore_eos. Once every request of
a batch is decoding, `--steps` steps are timed as they are (the step time printed), then as many
again under torch's profiler, whose per-operator self times are summed into kinds: matmuls,
attention, element-wise work and norms, copies and indexing, sampling, the rest. What no
operator accounts for ("outside operators": the engine's Python, scheduling, the profiler's
own cost) is the profiled step's time less the operators' time.

    python benchmarks/step_profile.py [--batch 1 32 64] [--steps 20] [--dtype auto] [--vllm-eager]

vLLM runs as its server runs it: compiled by torch.compile (inductor), which fuses its
element-wise work into generated kernels; the profiler sees those as compiled regions ("compiled
code" below). `--vllm-eager` runs it without compiling (enforce_eager), operator by operator, a
slower vLLM than users get: only for a breakdown by named operator.

vLLM runs with the Python of `$FLEETLLM_VLLM_PYTHON`, else `.venv-vllm/bin/python`; this
file runs there too, so it imports only the standard library and torch at
its top.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("compiled code", ("compiled", "cpp_fused")),
    ("attention", ("attention", "attn", "decode", "paged", "sdpa", "flash", "kv_cache",
                   "reshape_and_cache")),
    ("matmul", ("mm", "matmul", "linear", "gemm", "onednn", "mkldnn", "dot")),
    ("sampling", ("topk", "sort", "argmax", "multinomial", "exponential", "softmax", "cumsum",
                  "sample", "max", "log_softmax", "where")),
    ("copies and indexing", ("copy", "index", "cat", "gather", "scatter", "to", "contiguous",
                             "empty", "zeros", "full", "fill", "clone", "select", "slice",
                             "view", "reshape", "stack", "split", "narrow", "as_strided",
                             "tensor", "from", "unsqueeze", "transpose", "permute", "expand",
                             "embedding", "pad", "arange", "masked", "ones", "resize")),
    ("element-wise and norms", ("mul", "add", "sub", "div", "rsqrt", "pow", "mean", "silu",
                                "neg", "norm", "rotary", "sum", "exp", "sigmoid", "act",
                                "gelu", "square", "sqrt", "cos", "sin")),
]  # fmt: skip
"""Operator kinds by fragments of their names, tried in order (the first match wins)."""


def kind_of(name: str) -> str:
    bare = name.lower().rsplit("::", 1)[-1]
    for kind, fragments in KINDS:
        if any(f in bare for f in fragments):
            return kind
    return "other operators"


def breakdown(prof: profile, wall_ms: float, divisor: float) -> dict[str, Any]:
    """The profiled operators' self time by kind and the top operators, in ms / `divisor`;
    what no operator accounts for of `wall_ms` is "outside operators"."""
    kinds: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / divisor
        kind = kind_of(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
        top.append((ms, event.key))
    kinds["outside operators"] = wall_ms - sum(kinds.values())
    return {
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_ops_ms": [(name, round(ms, 3)) for ms, name in sorted(top, reverse=True)[:12]],
    }


def profile_steps(step: Callable[[], Any], steps: int) -> dict[str, Any]:
    """`steps` steps timed as they are, then `steps` under the profiler: the median step time
    and the profiled step's time by kind (ms per step)."""
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        profiled_ms = (time.perf_counter() - start) * 1000 / steps
    return {
        "step_ms": statistics.median(plain) * 1000,
        "profiled_step_ms": profiled_ms,
        **breakdown(prof, profiled_ms, steps),
    }


WARM_UP = list(range(1000, 1016))
"""A first request for each engine before anything is timed."""


def batch(size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(rng.randint(32, 256))] for _ in range(size)]


def prefill(step: Callable[[], int], size: int, prompt_tokens: int) -> dict[str, Any]:
    """Steps, under the profiler, until one advances every request of the batch (all have
    their first token): the time the whole batch's prefill took, by kind."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        steps = 1
        while step() != size:
            steps += 1
            if steps > 10_000:
                raise SystemExit("the batch never decoded all at once")
        wall_ms = (time.perf_counter() - start) * 1000
    return {
        "prefill_ms": wall_ms,
        "prefill_steps": steps,
        "prompt_tokens": prompt_tokens,
        **breakdown(prof, wall_ms, 1),
    }


def measure(engine: Any, add: Callable[[str, list[int]], None], args: argparse.Namespace,
            size: int) -> dict[str, Any]:  # fmt: skip
    prompts = batch(size, args.seed + size)
    for i, prompt in enumerate(prompts):
        add(f"{size}-{i}", prompt)
    advanced = lambda: len(engine.step())  # noqa: E731
    filled = prefill(advanced, size, sum(map(len, prompts)))
    for _ in range(args.warmup):
        engine.step()
    return {"prefill": filled, "decode": profile_steps(engine.step, args.steps)}


def named(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        with record_function(name):
            return method(*args)

    return wrapper


def fleetllm_engine(args: argparse.Namespace) -> dict[str, Any]:
    from throughput import linear_params, matmul_peak

    from fleetllm.engine import cpu_attention, cpu_kernels, layer_ops
    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling_params import SamplingParams

    # The engine's CPU kernels are pybind functions, which the profiler does not see: named
    # here (vLLM's kernels are torch operators, which it sees).
    for owner, method, name in [
        (cpu_attention.CpuPagedAttention, "decode", "decode"),
        (cpu_attention.CpuPagedAttention, "prefill", "paged_prefill"),
        (layer_ops.CpuLayerOps, "rms_norm", "rms_norm"),
        (layer_ops.CpuLayerOps, "rotary", "rotary"),
        (layer_ops.CpuLayerOps, "silu_and_mul", "silu_and_mul"),
    ]:
        setattr(owner, method, named(getattr(owner, method), f"fleetllm::{name}"))
    kernel = cpu_kernels.load_kernel()  # the module the engine's layers take it from
    if kernel is not None:
        kernel.few_rows_linear = named(kernel.few_rows_linear, "fleetllm::few_rows_linear")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(args.batch),
        max_model_len=args.max_model_len,
    )
    engine = llm.engine
    results: dict[str, Any] = {}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(WARM_UP, SamplingParams(max_tokens=4))
    for size in args.batch:
        results[str(size)] = measure(
            engine, lambda rid, prompt: engine.add_request(rid, prompt, params), args, size
        )
        for i in range(size):
            engine.abort_request(f"{size}-{i}")
    cfg = engine.model_config
    head = cfg.hidden_size * cfg.vocab_size
    results["matmul"] = {
        "peak_flops": matmul_peak(cfg, engine.dtype),
        "weights_per_token": linear_params(cfg) - head,
        "head": head,
    }
    llm.shutdown()
    return results


def vllm_engine(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch),
        enforce_eager=args.vllm_eager,
        seed=args.seed,
    )
    engine = llm.llm_engine
    results = {}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate({"prompt_token_ids": WARM_UP}, SamplingParams(max_tokens=4))
    for size in args.batch:
        results[str(size)] = measure(
            engine,
            lambda rid, prompt: engine.add_request(rid, {"prompt_token_ids": prompt}, params),
            args,
            size,
        )
        engine.abort_request([f"{size}-{i}" for i in range(size)])
        while engine.has_unfinished_requests():
            engine.step()
    return results


def print_kinds(found: dict[str, Any], total_ms: float) -> None:
    for kind, ms in found["by_kind_ms"].items():
        print(f"      {kind:<24} {ms:8.2f} ms  {100 * ms / total_ms:5.1f}%")
    print("      top operators: " + ", ".join(f"{n} {ms}" for n, ms in found["top_ops_ms"][:6]))


def print_table(name: str, results: dict[str, Any], matmul: dict[str, float] | None) -> None:
    """Each batch's prefill and decode by kind; with fleetllm's run, the matmuls' FLOP/s
    against the peak it measured (2 FLOPs per weight per token; the head's only for the rows
    whose logits are taken)."""
    for size, r in results.items():
        if size == "matmul":
            continue
        pre, dec = r["prefill"], r["decode"]
        if matmul is not None:
            weights, head = matmul["weights_per_token"], matmul["head"]
            for phase, flops, ms in [
                ("prefill", 2 * (pre["prompt_tokens"] * weights + int(size) * head),
                 pre["by_kind_ms"]["matmul"]),
                ("decode", 2 * int(size) * (weights + head), dec["by_kind_ms"]["matmul"]),
            ]:  # fmt: skip
                achieved = flops / ms * 1000
                r[f"{phase}_matmul_of_peak"] = achieved / matmul["peak_flops"]
                print(f"  {name:<8} batch {size:>3} {phase} matmuls: {achieved / 1e9:6.1f} "
                      f"GFLOP/s, {achieved / matmul['peak_flops']:.0%} of the peak")  # fmt: skip
        rate = pre["prompt_tokens"] / pre["prefill_ms"] * 1000
        print(f"  {name:<8} batch {size:>3} prefill: {pre['prompt_tokens']} prompt tokens "
              f"in {pre['prefill_ms']:.0f} ms, {pre['prefill_steps']} steps "
              f"({rate:.0f} tok/s):")  # fmt: skip
        print_kinds(pre, pre["prefill_ms"])
        rate = 1000 * int(size) / dec["step_ms"]
        print(f"  {name:<8} batch {size:>3} decode: step {dec['step_ms']:7.2f} ms ({rate:7.1f} "
              f"tok/s), profiled {dec['profiled_step_ms']:7.2f} ms:")  # fmt: skip
        print_kinds(dec, dec["profiled_step_ms"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", choices=["both", "fleetllm", "vllm"], default="both")
    ap.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="both engines (auto: fleetllm's choice)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument(
        "--vllm-eager", action="store_true", help="vLLM without torch.compile (slower than served)"
    )
    ap.add_argument("--in-vllm-python", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_vllm_python:  # started below, in vLLM's Python
        torch.set_num_threads(args.threads)
        args.json_out.write_text(json.dumps(vllm_engine(args)))
        return 0

    from fleetllm.engine import cpu_features
    from fleetllm.engine.model_files import resolve_model
    from fleetllm.local.vllm import find_vllm_python

    args.model = args.model or str(resolve_model("smollm2-135m"))
    if args.dtype == "auto":  # vLLM's auto is the checkpoint's (float32): give both ours
        args.dtype = "bfloat16" if cpu_features.native_bf16() else "float32"
    print(f"cpu flags : {cpu_features.describe()}")
    print(f"cores     : {os.cpu_count()}, threads {args.threads}; load average {os.getloadavg()}")
    print(f"model     : {args.model}; dtype {args.dtype}; {args.steps} steps per figure")
    found: dict[str, dict[str, Any]] = {}
    matmul = None
    if args.engine in ("both", "fleetllm"):
        found["fleetllm"] = fleetllm_engine(args)
        matmul = found["fleetllm"]["matmul"]
        print(f"matmul peak: {matmul['peak_flops'] / 1e9:.1f} GFLOP/s (the model's widest "
              "projection on 1024 rows, fleetllm's kernels and threads)")  # fmt: skip
        print_table("fleetllm", found["fleetllm"], matmul)
    if args.engine in ("both", "vllm"):
        python = find_vllm_python()
        if python is None:
            raise SystemExit("step_profile: vLLM's CPU build is not installed")
        out = Path(f"step_profile_vllm_{os.getpid()}.json")
        argv = [str(python), __file__, "--in-vllm-python", "--json-out", str(out)]
        for flag in ("model", "dtype", "threads", "max_model_len", "max_tokens", "seed",
                     "steps", "warmup"):  # fmt: skip
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        argv += ["--batch", *map(str, args.batch)]
        if args.vllm_eager:
            argv.append("--vllm-eager")
        env = os.environ | {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        try:
            subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
            found["vllm"] = json.loads(out.read_text())
        finally:
            out.unlink(missing_ok=True)
        print_table("vLLM", found["vllm"], matmul)
    if len(found) == 2:
        ours, theirs = found["fleetllm"], found["vllm"]
        print("fleetllm / vLLM, time (below 1: fleetllm is faster):")
        for size in theirs:
            pre = ours[size]["prefill"]["prefill_ms"] / theirs[size]["prefill"]["prefill_ms"]
            dec = ours[size]["decode"]["step_ms"] / theirs[size]["decode"]["step_ms"]
            print(f"  batch {size:>3}: prefill of the batch {pre:.2f}x, decode step {dec:.2f}x")
    print(f"load average at the end: {os.getloadavg()}")
    if args.json_out:
        args.json_out.write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
