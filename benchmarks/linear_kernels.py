"""Every linear layer of a model, on weights that come from memory as in an engine step:
fleetllm's packed linear (torch's oneDNN path, `engine/cpu_linear.py`), the same layer as the
engine runs it (up to `FEW_ROWS` rows on its own few-rows kernel), vLLM's `onednn_mm` and
`F.linear` (BLAS), at a few row counts, in one run.

Each layer gets weights of its own (random, the model's shapes, float32), so a pass over the
model streams them all from memory, as a decode step does; a figure is the median of
`--passes` passes. vLLM's kernel runs in vLLM's Python (`$FLEETLLM_VLLM_PYTHON`, else
`.venv-vllm/bin/python`; skipped with a note when it is not installed), this script's
`--in-vllm-python` mode.

    python benchmarks/linear_kernels.py [--model smollm2-135m] [--rows 1 32 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]


def shapes(config: dict[str, int]) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(in, out) of one layer's linears, the number of layers, and the head's (in, out)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    layer = [(hidden, qkv), (config["num_attention_heads"] * head_dim, hidden),
             (hidden, 2 * inter), (inter, hidden)]  # fmt: skip
    return layer, config["num_hidden_layers"], (hidden, config["vocab_size"])


def timed(config: dict[str, int], make: Callable[[torch.Tensor], Linear], rows: list[int],
          passes: int) -> dict[str, float]:  # fmt: skip
    """ms per pass over every linear of the model, per row count."""
    layer, layers, head = shapes(config)
    all_shapes = layer * layers + [head]
    kernels = [(k, make(torch.randn(n, k))) for k, n in all_shapes]
    out = {}
    for m in rows:
        inputs = {k: torch.randn(m, k) for k, _ in all_shapes}
        times = []
        for i in range(passes + 3):  # three passes to warm up
            start = time.perf_counter()
            for k, kernel in kernels:
                kernel(inputs[k])
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[str(m)] = statistics.median(times) * 1000
    return out


def fleetllm_packed(weight: torch.Tensor) -> Linear:
    from fleetllm.engine.cpu_linear import PackedLinear

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return PackedLinear(linear, batch_hint=64)  # the engine's layer, packed for 64 rows


def fleetllm_layer(weight: torch.Tensor) -> Linear:
    from fleetllm.engine import cpu_kernels
    from fleetllm.engine.cpu_linear import use_few_rows_kernel

    layer = fleetllm_packed(weight)
    kernel = cpu_kernels.load_kernel()
    if kernel is None:
        raise SystemExit("the engine's CPU kernels did not build: see the warning above")
    use_few_rows_kernel(layer, kernel)
    return layer


def blas(weight: torch.Tensor) -> Linear:
    return lambda x: F.linear(x, weight)


def vllm_onednn(weight: torch.Tensor) -> Linear:
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), 32)  # as vLLM's CPU linear layers make it
    return lambda x: ops.onednn_mm(handler, x, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--in-vllm-python", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.in_vllm_python is not None:
        config = json.loads(args.in_vllm_python.read_text())
        print(json.dumps(timed(config, vllm_onednn, args.rows, args.passes)))
        return 0

    from fleetllm.engine import cpu_features
    from fleetllm.engine.model_files import resolve_model
    from fleetllm.local.vllm import find_vllm_python

    config_file = resolve_model(args.model) / "config.json"
    config = json.loads(config_file.read_text())
    print(f"cpu flags: {cpu_features.describe()}; {args.threads} threads; {args.model}, float32")
    found = {
        "fleetllm packed": timed(config, fleetllm_packed, args.rows, args.passes),
        "fleetllm layer": timed(config, fleetllm_layer, args.rows, args.passes),
        "F.linear (BLAS)": timed(config, blas, args.rows, args.passes),
    }
    python = find_vllm_python()
    if python is None:
        print("vLLM's CPU build is not installed: its onednn_mm is not measured")
    else:
        argv = [str(python), __file__, "--in-vllm-python", str(config_file),
                "--threads", str(args.threads), "--passes", str(args.passes),
                "--rows", *map(str, args.rows)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        found["vLLM onednn_mm"] = json.loads(done.stdout.strip().splitlines()[-1])
    print("rows  " + "".join(f"{name:>20}" for name in found))
    for m in map(str, args.rows):
        print(f"{m:>4}  " + "".join(f"{found[name][m]:>17.1f} ms" for name in found))
    print(f"load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
