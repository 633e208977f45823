"""What one rank of the builtin engine holds, in bytes: its KV cache per token and its weights,
from the model's shape (the catalog's `ModelArch`), the dtype's size and the quantization.

No torch here: the planner sizes a replica with these formulas before any engine exists, and
the engine's own allocation reads the same constants (`kv_cache`, `quantization`, `loader`), so
what is planned and what is allocated is one fact with one owner. The integration tests load
shards and measure them against these formulas.
"""

from __future__ import annotations

from fleetllm.api.catalog import ModelArch

KV_SCALE_BYTES = 4
"""A quantized KV cache (int8, fp8) keeps one float32 scale per token and KV head beside the
one-byte values."""

INT8_GROUP = 32
"""int8 weights share a scale and an offset per group of this many inputs of a row."""

WEIGHT_SCALE_BYTES = 2
"""Quantized weights' scales (and int8's offsets) are 16-bit."""


MAX_NUM_BATCHED_TOKENS = 2048
"""A step's token budget where none is given (vLLM's), but on a CPU."""

CPU_MAX_NUM_BATCHED_TOKENS = 512
"""A CPU step's token budget where none is given. 512 rows already keep a CPU's matmuls at
their peak, while a step of 2048 prompt tokens takes seconds there, holding back every
decode and every other first token; measured in docs/benchmarks-vllm.md ("Step budget and
admission order"). The planner gives its CPU replicas the same budget, for its activations."""


def default_max_num_batched_tokens(device: str) -> int:
    return CPU_MAX_NUM_BATCHED_TOKENS if device == "cpu" else MAX_NUM_BATCHED_TOKENS


def int8_group(columns: int) -> int:
    """How many inputs of a row of `columns` share one int8 scale and offset: INT8_GROUP, or
    the whole row when INT8_GROUP does not divide it."""
    return INT8_GROUP if columns % INT8_GROUP == 0 else columns


def packs_linears(device: str, quantization: str | None) -> bool:
    """Whether the engine keeps its linear weights reordered for oneDNN (`cpu_linear`): on a
    CPU, unless quantization replaces them. A tied LM head is then a reordered copy of the
    embedding, held beside it. (Where oneDNN lacks the dtype the engine keeps plain linears
    and makes no copy.)"""
    return device == "cpu" and quantization is None


def keeps_plain_linears(packed: bool, dtype_bytes: int) -> bool:
    """Whether packed linears also keep their plain weight: in float32, for the few-rows
    kernel (`cpu_linear`), which reads it. A tied LM head's plain weight is the embedding."""
    return packed and dtype_bytes == 4


def kv_bytes_per_token(
    *, num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, dtype_bytes: int
) -> int:
    """Bytes of K and V of one token, all layers, on a rank holding `num_kv_heads` heads.
    `dtype_bytes`: the size of the model dtype, which an unquantized (`auto`) cache stores."""
    # Quantized: one byte per value, and the scale.
    per_head = head_dim * dtype_bytes if kv_cache_dtype == "auto" else head_dim + KV_SCALE_BYTES
    return 2 * num_layers * num_kv_heads * per_head


def weight_bytes_per_rank(
    arch: ModelArch, *, tensor: int, dtype_bytes: int, quantization: str | None, packed: bool
) -> int:
    """Weight bytes one of `tensor` ranks holds: its share of every projection (heads and MLP
    split evenly), of the vocabulary (ceil(vocab / tensor) rows of the embedding and of an
    untied head), and the norms and biases whole in the model dtype. Quantized (`int8`, `fp8`):
    one byte per value of the projections, the embedding and the head, plus 16-bit scales:
    int8 a scale and an offset per `int8_group` of a row, fp8 a scale per row. `packed`: the
    linears are reordered for oneDNN (`packs_linears`), so a tied head is a matrix of its
    own; in float32 each also keeps its plain weight (`keeps_plain_linears`)."""
    if arch.intermediate_size is None:
        raise ValueError(f"{arch.name}: the MLP's shape needs an intermediate size")
    hidden, head_dim, layers = arch.hidden_size, arch.head_dim, arch.num_layers
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) // tensor * head_dim
    mlp = arch.intermediate_size // tensor
    # (rows, columns) of each matrix of a layer: qkv, o, gate+up, down.
    layer = [
        (qkv_rows, hidden),
        (hidden, arch.num_heads // tensor * head_dim),
        (2 * mlp, hidden),
        (hidden, mlp),
    ]
    vocab_rows = -(-arch.vocab_size // tensor)
    matrices = [*layer * layers, (vocab_rows, hidden)]
    if not arch.tied_embeddings or packed:
        matrices.append((vocab_rows, hidden))
    if keeps_plain_linears(packed, dtype_bytes):
        matrices += layer * layers
        if not arch.tied_embeddings:
            matrices.append((vocab_rows, hidden))
    values = sum(rows * cols for rows, cols in matrices)
    norms = (2 * layers + 1) * hidden
    bias = layers * qkv_rows if arch.qkv_bias else 0
    unquantized = (norms + bias) * dtype_bytes
    if quantization is None:
        return values * dtype_bytes + unquantized
    if quantization == "int8":
        # A scale and an offset per group.
        scales = sum(rows * 2 * (cols // int8_group(cols)) for rows, cols in matrices)
    else:
        scales = sum(rows for rows, _ in matrices)
    return values * 1 + scales * WEIGHT_SCALE_BYTES + unquantized


def lora_bytes_per_rank(
    arch: ModelArch, *, tensor: int, max_loras: int, max_lora_rank: int, dtype_bytes: int
) -> int:
    """Bytes of the LoRA slots one of `tensor` ranks holds (`lora_layers`): for each of
    `max_loras` slots and each layer, A [rank, in] of every adapted projection (q, k, v, o,
    gate, up, down) at `max_lora_rank`, and B [out, parts * rank] of each of the engine's four
    layers (qkv and gate/up fuse 3 and 2 parts, B block-diagonal over them), in the model
    dtype. A column-parallel layer (qkv, gate/up) holds all of A and its rows of B; a
    row-parallel one (o, down) its columns of A and all of B."""
    if arch.intermediate_size is None:
        raise ValueError(f"{arch.name}: the MLP's shape needs an intermediate size")
    hidden = arch.hidden_size
    q_rows = arch.num_heads // tensor * arch.head_dim
    kv_rows = arch.num_kv_heads // tensor * arch.head_dim
    mlp = arch.intermediate_size // tensor
    # Values per unit of rank of A and B of each layer, as this rank holds them.
    per_layer = (
        3 * hidden
        + (q_rows + 2 * kv_rows) * 3  # qkv: A 3 parts x hidden, B 3 parts wide
        + q_rows
        + hidden  # o
        + 2 * hidden
        + 2 * mlp * 2  # gate/up: A 2 parts x hidden, B 2 parts wide
        + mlp
        + hidden  # down
    )
    return max_loras * max_lora_rank * arch.num_layers * per_layer * dtype_bytes
