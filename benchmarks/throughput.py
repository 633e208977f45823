"""Offline throughput: fleetllm's engine against Hugging Face transformers, same workload.

Workload: N requests, prompts of random token ids (32..256 tokens), outputs of 16..128 tokens
with ignore_eos, greedy. Hugging Face runs static batches (prompts left-padded; a batch runs
until its longest output is done, and only the requested tokens count); it tries several batch
sizes and keeps its best. fleetllm runs every request through continuous batching.

It also times our engine step against a bare forward pass of the same batch (model forward +
logits, nothing else) to show the engine's own overhead, and a large matmul of the model's own
shapes (its widest projection, 1024 rows) on the same threads, in the same dtype and through
the same linear kernels: the decode step's FLOP/s as a fraction of that matmul's is how close
decoding comes to what this CPU attains. The dtype is the engine's `auto` choice unless given;
the CPU flags it was chosen from, the instruction sets torch's kernels run with (capped by
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS to measure as on an older
CPU) and the load average are printed with the figures. Both sides run on the same threads, and
timings are only meaningful while nothing else competes for them: with more runnable threads
than cores, every parallel region waits for a descheduled thread. `--busy-neighbour` measures
exactly that: a process spins on the last CPU throughout (a neighbour pod, a client), the engine
with its thread governor (or without: `--no-adaptive-threads`; engine/cpu_threads.py).

    python benchmarks/throughput.py [--model smollm2-135m] [--dtype auto] [--threads 2]
        [--busy-neighbour] [--no-adaptive-threads]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from fleetllm.engine import cpu_features
from fleetllm.engine.config import DTYPES, ModelConfig
from fleetllm.engine.cpu_linear import PackedLinear, packing_supported
from fleetllm.engine.llm import LLM
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.sampling_params import SamplingParams

FIRST_ORDINARY_ID = 1000
"""Prompts take ids from here to the vocabulary's end: the specials sit at the start."""


def make_workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(32, 256))],
            rng.randint(16, 128),
        )
        for _ in range(n)
    ]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_hf(model_dir, dtype, workload, batch_sizes) -> tuple[float, int, dict[int, float]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    useful = sum(out for _, out in workload)
    results: dict[int, float] = {}
    for bs in batch_sizes:
        start = time.perf_counter()
        for i in range(0, len(workload), bs):
            batch = workload[i : i + bs]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            new = max(out for _, out in batch)
            with torch.inference_mode():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
        elapsed = time.perf_counter() - start
        results[bs] = useful / elapsed
        log(f"  hf batch={bs:3d}: {results[bs]:8.1f} output tok/s ({elapsed:.1f} s)")
    best = max(results, key=results.__getitem__)
    return results[best], best, results


def run_ours(llm: LLM, workload) -> float:
    params = [
        SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in workload
    ]
    prompts = [p for p, _ in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(out for _, out in workload)
    assert llm.engine.stats().kv_cache_usage == 0.0
    return produced / elapsed


def linear_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies through: the projections of all layers and the head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.hidden_size * cfg.vocab_size


def decode_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one decode step of `batch` sequences of about `context` tokens: 2 per weight
    per token, and the attention's QK^T and PV over the context."""
    attention = cfg.num_layers * 4 * context * cfg.num_heads * cfg.head_dim
    return batch * (2.0 * linear_params(cfg) + attention)


def matmul_peak(cfg: ModelConfig, dtype: torch.dtype, rows: int = 1024, iters: int = 10) -> float:
    """FLOP/s of the model's widest projection (gate and up: hidden -> 2 x intermediate) on
    `rows` rows, through the kernels the engine uses for this dtype; the best of `iters`."""
    linear = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
    module: torch.nn.Module = linear
    if packing_supported(dtype, torch.device("cpu")):
        module = PackedLinear(linear, rows)
    x = torch.randn(rows, cfg.hidden_size, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        module(x)  # warm-up
        for _ in range(iters):
            t = time.perf_counter()
            module(x)
            best = min(best, time.perf_counter() - t)
    return 2.0 * rows * cfg.hidden_size * 2 * cfg.intermediate_size / best


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def torch_isa() -> str:
    """What torch actually runs with: the flags above say what the CPU has, but the variables
    of ISA_LIMITS cap the kernels below it (to measure as on an older CPU)."""
    ops = torch.ops.mkldnn
    bf16 = hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()
    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if name in os.environ]
    return (
        f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN native bfloat16 "
        f"{'yes' if bf16 else 'no'}; {' '.join(limits) if limits else 'no ISA limits set'}"
    )


def step_overhead(llm: LLM, batch: int, context: int, iters: int) -> tuple[float, float]:
    """Median engine step time vs median bare forward time, both in decode with `batch`
    running requests of about `context` tokens."""
    engine = llm.engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(context)]
        engine.add_request(f"o{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # finish every prefill: from here on each step is a pure decode batch
    step_times = []
    for _ in range(iters):
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    # The same batch shape, forward only: the scheduler's current batch, prepared once.
    scheduled = engine.scheduler.schedule().scheduled
    runner = engine.runner
    step, _, _ = engine.step_builder.build(scheduled, engine.kv.take_fresh_blocks())
    fwd_times = []
    with torch.inference_mode():
        inp = runner.prepare(step)
        for _ in range(iters):
            t = time.perf_counter()
            hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.attn_metadata)
            runner.model.compute_logits(hidden[inp.logits_indices])
            fwd_times.append(time.perf_counter() - t)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return statistics.median(step_times), statistics.median(fwd_times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="only measure fleetllm")
    ap.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's thread governor (engine/cpu_threads.py)",
    )
    ap.add_argument(
        "--busy-neighbour",
        action="store_true",
        help="run a process spinning on the last CPU throughout, as a neighbour "
        "pod or a client would take a core",
    )
    args = ap.parse_args()
    with busy_neighbour(args.busy_neighbour):
        return measure(args)


@contextlib.contextmanager
def busy_neighbour(wanted: bool) -> Iterator[None]:
    if not wanted:
        yield
        return
    cpu = max(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    spinner = subprocess.Popen([sys.executable, "-c", code])
    log(f"busy neighbour: a process spinning on CPU {cpu}")
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def measure(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model_dir = resolve_model(args.model)
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        num_kv_blocks=2048,
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        adaptive_threads=args.adaptive_threads,
    )
    cfg = llm.engine.model_config
    dtype = llm.engine.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    workload = make_workload(args.requests, cfg.vocab_size, args.seed)
    log(
        f"workload: {args.requests} requests, {sum(len(p) for p, _ in workload)} prompt tokens, "
        f"{sum(o for _, o in workload)} output tokens; {args.model} {dtype_name} "
        f"(--dtype {args.dtype}), {args.threads} threads "
        f"({'adaptive' if args.adaptive_threads else 'fixed'})"
        f"{', busy neighbour' if args.busy_neighbour else ''}"
    )

    llm.generate(workload[0][0], SamplingParams(max_tokens=4))  # warm-up
    ours = run_ours(llm, workload)
    log(f"  fleetllm:       {ours:8.1f} output tok/s")
    governor = getattr(llm.engine.executor, "threads", None)
    if governor is not None:
        log(f"  compute threads at the end: {governor.threads} of {governor.max_threads}")
    context = 192
    step, fwd = step_overhead(llm, batch=args.max_num_seqs, context=context, iters=20)
    peak = matmul_peak(cfg, dtype)
    achieved = decode_flops(cfg, args.max_num_seqs, context) / step

    print(f"cpu flags           : {cpu_features.describe()}")
    print(f"torch kernels       : {torch_isa()}")
    print(f"dtype               : {dtype_name} (--dtype {args.dtype}), {args.threads} threads")
    print(f"fleetllm engine     : {ours:8.1f} output tokens/s")
    if not args.skip_hf:
        batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
        hf, best, _ = run_hf(model_dir, dtype, workload, batch_sizes)
        print(f"HF transformers     : {hf:8.1f} output tokens/s (best static batch {best})")
        print(f"ratio fleetllm / HF : {ours / hf:8.2f}x")
    print(
        f"decode step ({args.max_num_seqs} seqs): {step * 1e3:.1f} ms; bare forward "
        f"{fwd * 1e3:.1f} ms; overhead {step / fwd:.3f}x"
    )
    print(
        f"decode FLOP/s       : {achieved / 1e9:8.1f} GFLOP/s = {achieved / peak:.1%} of a "
        f"{cfg.hidden_size}x{2 * cfg.intermediate_size} matmul's {peak / 1e9:.1f} GFLOP/s"
    )
    load_after = os.getloadavg()
    print(f"load average        : {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
