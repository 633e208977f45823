"""The planner's part of LoRA (`spec.lora`): the memory the engines' adapter slots take, their
flags, and the environment that opens the engines' runtime load API. Pure.

Memory. An engine reserves `maxLoras` slots, each big enough for an adapter of `maxLoraRank` on
every projection it adapts: q, k, v, o, gate, up and down of every layer. An adapter of rank r
on a projection of `inputs` -> `outputs` is A (r x inputs) and B (outputs x r), in the model
dtype. Under tensor parallelism each rank keeps the slots of its own shard: the column-parallel
projections (q, k, v, gate, up) split B's outputs and keep A whole, the row-parallel ones (o,
down) split A's inputs and keep B whole, as the base layers are split; a pipeline stage keeps
the slots of its own layers. Per device and slot:

    r x layers / pipeline
      x (7 x hidden + ((2 x heads + 2 x kv_heads) x head_dim + 3 x intermediate) / tensor)

The adapters kept loaded beyond the slots (`maxCpuLoras`) are in host memory: on a CPU replica
that is the replica's own memory, so they count there too (at the highest rank, the most each
may take); on a GPU they are outside the device budget.

This is vLLM's layout. The builtin engine allocates its slots by its own formula, which this
module is to call for that backend once the engine has LoRA (`fleetllm.engine.sizing`, its
`lora_bytes_per_rank`: it keeps B block-diagonal over the fused qkv and gate/up projections,
so those B take 3x and 2x what they take here); until then both backends are counted so.
"""

from __future__ import annotations

import math

from fleetllm.api.catalog import ModelArch
from fleetllm.api.lora import LoraSpec

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set; the builtin
engine reads the same variable."""


def slot_bytes(
    arch: ModelArch, rank: int, *, tensor: int, pipeline: int = 1, dtype_bytes: int
) -> int:
    """Bytes one adapter slot of `rank` takes on one device of `tensor` x `pipeline`."""
    hidden, head_dim = arch.hidden_size, arch.head_dim
    intermediate = arch.intermediate_size or 4 * hidden  # as the activations are estimated
    kv_heads = max(1, arch.num_kv_heads // tensor) * tensor  # replicated below one per rank
    sharded = ((2 * arch.num_heads + 2 * kv_heads) * head_dim + 3 * intermediate) // tensor
    layers = math.ceil(arch.num_layers / pipeline)
    return rank * layers * (7 * hidden + sharded) * dtype_bytes


def lora_bytes(
    arch: ModelArch,
    lora: LoraSpec | None,
    *,
    tensor: int,
    pipeline: int = 1,
    dtype_bytes: int,
    on_gpu: bool,
) -> int:
    """Bytes LoRA takes from one device's budget: the slots, and on a CPU the adapters kept
    loaded beside them. 0 without LoRA."""
    if lora is None:
        return 0
    slots = lora.max_loras if on_gpu else lora.max_loras + lora.cpu_loras
    rank = lora.max_lora_rank
    return slots * slot_bytes(arch, rank, tensor=tensor, pipeline=pipeline, dtype_bytes=dtype_bytes)


def lora_args(lora: LoraSpec | None) -> list[str]:
    """The flags of both backends (vLLM's spelling); none without LoRA."""
    if lora is None:
        return []
    return [
        "--enable-lora",
        "--max-loras",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_lora_rank),
        "--max-cpu-loras",
        str(lora.cpu_loras),
    ]


def lora_env(lora: LoraSpec | None) -> dict[str, str]:
    """What the engine's environment needs for the adapters to be loaded while it runs."""
    return {} if lora is None else {RUNTIME_LORA_ENV: "true"}
