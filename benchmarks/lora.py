"""The cost of LoRA: one batch mixing the base model and two adapters against the same batch on
the base model alone, in one run, on one engine.

Workload: SmolLM2-135M, `--requests` prompts of random tokens, each `--output-tokens` long
(greedy, ignore_eos), all submitted at once; the mixed batch sends a third of them to each of
the base model and two seeded random adapters (rank `--rank` on q, k, v, o, gate, up and down,
written in PEFT's format). The baseline runs the same engine (LoRA enabled, so the model and
its memory are the same) with every request on the base model. Each figure is the best of
`--repeats` runs; the script prints both, their ratio, and the machine's load.

    python benchmarks/lora.py [--requests 12] [--output-tokens 32] [--rank 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import save_file

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.lora_adapter import MODULE_PARENTS, LoRAAdapter, module_shape
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.sampling_params import SamplingParams


def write_adapter(engine: LLMEngine, path: Path, rank: int, seed: int) -> LoRAAdapter:
    """A seeded random adapter of every projection, in PEFT's format, read by the engine."""
    cfg = engine.model_config
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, block in MODULE_PARENTS.items():
            inputs, outputs = module_shape(cfg, module)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, inputs, generator=g) / inputs**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=g) * 0.02
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(MODULE_PARENTS)}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return engine.load_lora(path.name, str(path))


def run(
    engine: LLMEngine, prompts: list[list[int]], loras: list[LoRAAdapter | None], tokens: int
) -> float:
    """Tokens per second of the whole batch, submitted at once and stepped to the end, every
    prompt prefilled (the prefix cache emptied first: the runs repeat the same prompts)."""
    engine.kv.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{i}", prompt, params, lora=lora)
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    assert produced == tokens * len(prompts)
    return produced / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8, choices=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    llm = LLM(
        str(resolve_model("smollm2-135m")),
        dtype=args.dtype,
        num_kv_blocks=1024,
        max_model_len=1024,
        max_num_seqs=args.requests,
        num_threads=args.threads,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=args.rank,
    )
    engine = llm.engine
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 49152) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [write_adapter(engine, Path(tmp) / f"a{i}", args.rank, i) for i in (1, 2)]
    mixed = [[None, *adapters][i % 3] for i in range(args.requests)]
    base_only: list[LoRAAdapter | None] = [None] * args.requests
    run(engine, prompts[:3], mixed[:3], 4)  # warm up: every slot loaded, kernels ready
    best = {"base only": 0.0, "base + 2 adapters": 0.0}
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        best["base only"] = max(
            best["base only"], run(engine, prompts, base_only, args.output_tokens)
        )
        best["base + 2 adapters"] = max(
            best["base + 2 adapters"], run(engine, prompts, mixed, args.output_tokens)
        )
    load = os.getloadavg()[0]
    print(
        f"SmolLM2-135M {args.dtype}, {args.requests} requests x {args.output_tokens} tokens, "
        f"rank {args.rank}, {args.threads} threads, load {load:.1f}",
        file=sys.stderr,
    )
    ratio = best["base + 2 adapters"] / best["base only"]
    print(
        f"base + 2 adapters vs base only: {best['base + 2 adapters']:.1f} vs "
        f"{best['base only']:.1f} tok/s, ratio {ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
