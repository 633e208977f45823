"""The engine's serving options against its plain configuration, each pair in one run:

- tp:   tensor_parallel_size=3 (three worker processes, gloo) vs one process;
- int8: int8 weights (and an int8 KV cache) vs unquantized, tokens/s and bytes held;
- spec: n-gram speculative decoding on vs off, on repetitive text and on random tokens,
        with the acceptance rate and the number of engine steps. Greedy continuations of
        random tokens soon loop, which n-gram drafts predict; random tokens sampled at
        temperature 1 stand for text that does not repeat.

Workload: SmolLM2-135M, greedy unless said, every request `--output-tokens` long (ignore_eos).
Prints each figure, the ratio ours / baseline, the machine's load and the CPU features torch
uses.

    python benchmarks/engine_options.py [--only tp,int8,spec] [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from fleetllm.engine.llm import LLM
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.sampling_params import SamplingParams

REPETITIVE = [
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Roses are red, violets are blue. Roses are red, violets are blue. Roses are red,",
    "| name | size |\n| --- | --- |\n| a | 1 |\n| b | 2 |\n| c | 3 |\n| d | 4 |\n| e |",
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_flags() -> str:
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    have = [flag for flag in wanted if flag in flags]
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; flags {' '.join(have)}"


@dataclass
class Run:
    tokens_per_s: float
    request_steps: int  # steps summed over requests: those in which each gained tokens
    stats: Any


def generate(
    llm: LLM, prompts: list[Any], output_tokens: int, repeats: int = 2, temperature: float = 0
) -> Run:
    """All prompts at once, stepping the engine by hand; the best of `repeats` runs."""
    engine = llm.engine
    params = SamplingParams(
        temperature=temperature, seed=0, max_tokens=output_tokens, ignore_eos=True
    )
    best: Run | None = None
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{i}", prompt, params)
        request_steps = produced = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            request_steps += len(outputs)
            produced += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        elapsed = time.perf_counter() - start
        assert produced == output_tokens * len(prompts)
        run = Run(produced / elapsed, request_steps, engine.stats())
        if best is None or run.tokens_per_s > best.tokens_per_s:
            best = run
    assert best is not None
    return best


def build(model_dir: str, args: argparse.Namespace, **options: Any) -> LLM:
    # The ranks of a tensor-parallel engine share the cores: each takes its part.
    threads = max(1, args.threads // options.get("tensor_parallel_size", 1))
    return LLM(
        model_dir,
        dtype=args.dtype,
        num_kv_blocks=512,
        max_model_len=2048,
        max_num_seqs=args.requests,
        num_threads=threads,
        **options,
    )


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 49152) for _ in range(length)] for _ in range(n)]


def bench_tp(model_dir: str, args: argparse.Namespace) -> None:
    prompts = random_prompts(args.requests, 64)
    results = {}
    for size in (1, 3):
        with build(model_dir, args, tensor_parallel_size=size) as llm:
            generate(llm, prompts[:1], 4)  # warm up
            results[size] = generate(llm, prompts, args.output_tokens)
            shares = llm.engine.weight_bytes
        log(
            f"  tensor_parallel_size={size}: {results[size].tokens_per_s:8.1f} tok/s, "
            f"weights per rank {', '.join(f'{b / 2**20:.1f} MiB' for b in shares)}"
        )
    ratio = results[3].tokens_per_s / results[1].tokens_per_s
    print(
        f"TP=3 vs TP=1 ({args.requests} requests x {args.output_tokens} tokens): "
        f"{results[3].tokens_per_s:.1f} vs {results[1].tokens_per_s:.1f} tok/s, ratio {ratio:.2f}"
    )


def bench_int8(model_dir: str, args: argparse.Namespace) -> None:
    prompts = random_prompts(args.requests, 64)
    rows = []
    for label, options in (
        ("unquantized", {}),
        ("int8 weights", {"quantization": "int8"}),
        ("int8 weights + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"}),
    ):
        with build(model_dir, args, **options) as llm:
            generate(llm, prompts[:1], 4)
            run = generate(llm, prompts, args.output_tokens)
            slots = (llm.engine.kv.num_blocks + 1) * llm.engine.kv.block_size
            rows.append(
                (
                    label,
                    run.tokens_per_s,
                    llm.engine.weight_bytes[0],
                    llm.engine.kv_cache_bytes[0] / slots,
                )
            )
        log(f"  {label}: {run.tokens_per_s:8.1f} tok/s")
    base = rows[0]
    for label, tps, weights, kv in rows:
        print(
            f"{label:24s} {tps:8.1f} tok/s (x{tps / base[1]:.2f}), weights "
            f"{weights / 2**20:7.1f} MiB (x{weights / base[2]:.3f}), KV {kv:6.0f} B/token "
            f"(x{kv / base[3]:.3f})"
        )


def bench_spec(model_dir: str, args: argparse.Namespace) -> None:
    """One request at a time (speculation is for latency under light load): tokens/s over the
    requests, and decode steps summed over them."""
    with build(model_dir, args) as plain_llm:
        tokenizer = plain_llm.get_tokenizer()
        # name: (prompts, temperature)
        workloads = {
            "repetitive": ([tokenizer.encode(p) for p in REPETITIVE], 0.0),
            "random": (random_prompts(len(REPETITIVE), 48), 0.0),
            "random, sampled": (random_prompts(len(REPETITIVE), 48), 1.0),
        }
        plain = {name: alone(plain_llm, *work, args) for name, work in workloads.items()}
    with build(model_dir, args, speculative_config=NGRAM) as spec_llm:
        for name, work in workloads.items():
            before = spec_llm.engine.stats()
            tps, steps = alone(spec_llm, *work, args)
            after = spec_llm.engine.stats()
            drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
            )
            base_tps, base_steps = plain[name]
            print(
                f"speculation on {name:15s} text: {tps:7.1f} vs {base_tps:7.1f} tok/s "
                f"(x{tps / base_tps:.2f}), steps {steps} vs {base_steps} "
                f"(x{base_steps / steps:.2f} fewer), {accepted}/{drafts} drafts accepted "
                f"({accepted / max(drafts, 1):.0%})"
            )


def alone(
    llm: LLM, prompts: list[Any], temperature: float, args: argparse.Namespace
) -> tuple[float, int]:
    generate(llm, prompts[:1], 4, repeats=1)  # warm up
    runs = [generate(llm, [p], args.output_tokens, temperature=temperature) for p in prompts]
    seconds = sum(args.output_tokens / r.tokens_per_s for r in runs)
    return args.output_tokens * len(runs) / seconds, sum(r.request_steps for r in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--only", default="tp,int8,spec")
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    print(f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {cpu_flags()}")
    print(f"model {args.model}, dtype {args.dtype}, {args.threads} threads")
    benches = {"tp": bench_tp, "int8": bench_int8, "spec": bench_spec}
    for name in args.only.split(","):
        log(f"{name} ...")
        benches[name](model_dir, args)
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
