"""LoRA on a rank's model: device slots of stacked adapter weights, and the projections that
add each row's own adapter delta.

Every adapted projection (q/k/v, o, gate/up, down) is wrapped in a `LoRALinear` holding, for
each of `max_loras` slots, A [parts * max_rank, in] and B [out, parts * max_rank] of this rank's
shard (smaller ranks zero-padded, absent modules zero). A fused layer's parts (q, k and v; gate
and up) stack their A by rows, and B is block-diagonal over them (part i's output rows read only
part i's rank columns), so one matmul shrinks and one expands every part: a step costs a few
operations per projection and slot, which is what matters on small models. A step's batch mixes
rows of several adapters and of the base model: before the forward the runner sets
`LoRAState.batch`, the rows of each slot in use, and each projection then computes, per slot in
use (at most `max_loras`, never per request), `y[rows] += (x[rows] @ A^T) @ B^T`; base rows are
left exactly as the base computed them. A step without adapter rows runs the base layers alone.

A CUDA graph replays fixed shapes, so a decode graph runs every slot over every row instead,
each masked to its own rows (`LoRABatch.masks`, a static buffer the graph runner fills):
`y += ((x * mask_s) @ A_s^T) @ B_s^T`; rows of other slots and of the base add exact zeros.

Tensor parallelism shards the adapter as the base layer is sharded: a column-parallel layer
(q/k/v, gate/up: output rows split) takes its rows of B and all of A; a row-parallel one (o,
down: input columns split) takes its columns of A and all of B, and its partial delta joins
the base's partial output before the all-reduce that sums them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fleetllm.engine.lora_adapter import LoRAAdapter, module_shape
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.parallel import TensorParallel

# Each wrapped layer of a decoder layer: its path, the PEFT modules fused in it (in the order
# of its output rows), and whether it is row-parallel (input columns split).
LORA_LAYERS = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), False),
    ("self_attn.o_proj", ("o_proj",), True),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj"), False),
    ("mlp.down_proj", ("down_proj",), True),
)


@dataclass(frozen=True)
class LoRABatch:
    """The rows (token indices of the step) of each device slot in use (None: every row); or,
    in a CUDA graph, `masks` [max_loras, rows, 1]: 1 where a row belongs to the slot."""

    groups: list[tuple[int, torch.Tensor | None]]
    masks: torch.Tensor | None = None


def lora_batch(slots: list[int], query_lens: list[int], device: torch.device) -> LoRABatch | None:
    """Each request's slot (-1: the base model) and its number of tokens in the step, in the
    step's token order -> the rows of each slot; None when no request uses an adapter."""
    rows: dict[int, list[int]] = {}
    start = 0
    for slot, n in zip(slots, query_lens, strict=True):
        if slot >= 0:
            rows.setdefault(slot, []).extend(range(start, start + n))
        start += n
    if not rows:
        return None
    if len(rows) == 1 and len(next(iter(rows.values()))) == start:
        return LoRABatch([(next(iter(rows)), None)])  # one adapter, no base rows
    return LoRABatch(
        [(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())]
    )


class LoRAState:
    """A rank's slots: the wrapped layers, the adapter key each slot holds, and the batch of
    the step being run."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.layers: list[tuple[int, LoRALinear]] = []  # (decoder layer index, layer)
        self.keys: list[bytes | None] = [None] * max_loras
        self.batch: LoRABatch | None = None

    @property
    def nbytes(self) -> int:
        return sum(layer.a.nbytes + layer.b.nbytes for _, layer in self.layers)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write this rank's shard of `adapter` into `slot` (what it held is overwritten)."""
        if self.keys[slot] == adapter.key:
            return
        for index, layer in self.layers:
            layer.load(slot, index, adapter)
        self.keys[slot] = adapter.key


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        modules: tuple[str, ...],
        shapes: list[tuple[int, int]],
        row_parallel: bool,
        tp: TensorParallel,
        state: LoRAState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`shapes`: each module's (in, out) in the whole model."""
        super().__init__()
        self.base = base
        self.targets = modules
        self.row_parallel = row_parallel
        self.tp = tp
        self.state = state
        rank = state.max_rank
        full_in = shapes[0][0]
        self.in_features = full_in // tp.size if row_parallel else full_in
        self.out_sizes = [out if row_parallel else out // tp.size for _, out in shapes]
        # Slot tensors are plain attributes, not parameters or buffers: the model's weights
        # (and their byte count) are the base model's alone.
        self.a = torch.zeros(
            state.max_loras, len(modules) * rank, self.in_features, dtype=dtype, device=device
        )
        self.b = torch.zeros(
            state.max_loras, sum(self.out_sizes), len(modules) * rank, dtype=dtype, device=device
        )

    def load(self, slot: int, layer_index: int, adapter: LoRAAdapter) -> None:
        rank = self.state.max_rank
        a_slot, b_slot = self.a[slot], self.b[slot]
        a_slot.zero_()
        b_slot.zero_()
        start = 0
        for i, (module, out) in enumerate(zip(self.targets, self.out_sizes, strict=True)):
            pair = adapter.weights.get((layer_index, module))
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                if self.row_parallel:
                    lo, hi = self.tp.split(a.shape[1])
                    a = a[:, lo:hi]
                else:
                    lo, hi = self.tp.split(b.shape[0])
                    b = b[lo:hi]
                a_slot[i * rank : i * rank + r].copy_(a)
                b_slot[start : start + out, i * rank : i * rank + r].copy_(b)
            start += out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        if batch.masks is not None:
            for slot, mask in enumerate(batch.masks):
                y.addmm_((x * mask) @ self.a[slot].t(), self.b[slot].t())
            return y
        for slot, rows in batch.groups:
            if rows is None:
                y.addmm_(x @ self.a[slot].t(), self.b[slot].t())
            else:
                xa = x.index_select(0, rows) @ self.a[slot].t()
                y.index_add_(0, rows, xa @ self.b[slot].t())
        return y


def add_lora_layers(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, dtype: torch.dtype
) -> LoRAState:
    """Wrap every adapted projection of a loaded (packed or quantized) model; the state is
    also kept as `model.lora`."""
    cfg, tp = model.config, model.tp
    device = model.model.rotary.cos.device
    state = LoRAState(max_loras, max_rank, dtype)
    for index, decoder in enumerate(model.model.layers):
        for path, modules, row_parallel in LORA_LAYERS:
            block_name, name = path.split(".")
            block = getattr(decoder, block_name)
            shapes = [module_shape(cfg, m) for m in modules]
            layer = LoRALinear(
                getattr(block, name), modules, shapes, row_parallel, tp, state, dtype, device
            )
            setattr(block, name, layer)
            state.layers.append((index, layer))
    model.lora = state
    return state
