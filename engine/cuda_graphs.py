"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is mostly kernel-launch overhead: dozens of small
kernels per layer. Capturing the whole forward (embedding to logits) once per batch size and
replaying it costs one launch. A graph reads and writes fixed addresses, so every input lives
in a static buffer sized for the largest bucket; a batch of n decodes runs in the smallest
bucket >= n, its rows [n, bucket) padded: token 0 at position 0 with a context of 0 (the
decode kernel makes that row zeros) writing its K/V to the null block's first slot, which
nothing reads as context. Prefill steps and batches above the largest bucket run eagerly.

The attention in a graph must not depend on per-step shapes: the decode path of the Triton
backend, which reads full-width block tables and context lengths. With LoRA, each row's adapter
slot lives in a static buffer too (`lora_masks`): a second graph per bucket runs every slot's
delta over every row, masked to its own rows, for the steps with adapter rows; steps of the base
model alone replay the first, which has no LoRA in it.
`capture=False` runs the same padded static-buffer forward eagerly, which is how the bucket and
padding logic is tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from fleetllm.engine.attention import AttentionMetadata
from fleetllm.engine.block_manager import NULL_BLOCK
from fleetllm.engine.lora_layers import LoRABatch
from fleetllm.engine.model import LlamaForCausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs
    (rounded up to a bucket) and at most 512 (vLLM's defaults)."""
    sizes = [1, 2, 4, 8, *range(16, 513, 8)]
    cap = next((s for s in sizes if s >= max_num_seqs), sizes[-1])
    return [s for s in sizes if s <= cap]


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        table_width: int,
        sizes: Sequence[int],
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.device = device
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.full((n, table_width), NULL_BLOCK, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.long, device=device)
        lora = model.lora
        self.lora_masks = (
            None
            if lora is None
            else torch.zeros(lora.max_loras, n, 1, dtype=lora.dtype, device=device)
        )
        # One graph per (bucket, with LoRA): the LoRA variant only where the model has LoRA.
        self.variants = (False, True) if model.lora is not None else (False,)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        if capture:
            self._capture()

    def _forward(self, size: int, with_lora: bool) -> torch.Tensor:
        md = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_tables=self.tables[:size],
            decode_context_lens=self.context_lens[:size],
            decode_mask=None,
            prefills=[],
        )
        lora = self.model.lora if with_lora else None
        if lora is not None:
            assert self.lora_masks is not None
            lora.batch = LoRABatch([], masks=self.lora_masks[:, :size])
        try:
            hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, md)
        finally:
            if lora is not None:
                lora.batch = None
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then reuse its memory from the shared pool.
        for key in [(size, v) for size in reversed(self.sizes) for v in self.variants]:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: kernels compiled and autotuned outside capture
                    self._forward(*key)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[key] = self._forward(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs", extra={"batch_sizes": self.sizes})

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        tables: list[torch.Tensor],
        context_lens: list[int],
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Float32 logits [n, vocab] of n decodes (n <= max_size): token, its position, the
        sequence's block table (a CPU row of block ids) and context length (with the token),
        and its LoRA slot (-1 or None: the base model)."""
        n = len(input_ids)
        size = bucket_for(n, self.sizes)
        assert size is not None, f"{n} decodes exceed the largest bucket {self.max_size}"
        bs = self.block_size
        slots = [
            int(t[(c - 1) // bs]) * bs + (c - 1) % bs
            for t, c in zip(tables, context_lens, strict=True)
        ]
        pad = size - n
        self._fill(self.input_ids, input_ids + [0] * pad)
        self._fill(self.positions, positions + [0] * pad)
        self._fill(self.slot_mapping, slots + [NULL_BLOCK * bs] * pad)
        self._fill(self.context_lens, context_lens + [0] * pad)
        width = self.tables.shape[1]
        rows = torch.stack([t[:width] for t in tables])
        if pad:
            rows = torch.cat([rows, torch.full((pad, width), NULL_BLOCK, dtype=torch.long)])
        self.tables[:size].copy_(rows, non_blocking=True)
        with_lora = lora_slots is not None and any(slot >= 0 for slot in lora_slots)
        if with_lora:
            assert self.lora_masks is not None and lora_slots is not None
            masks = torch.zeros(self.lora_masks.shape[0], size, 1, dtype=self.lora_masks.dtype)
            for row, slot in enumerate(lora_slots):
                if slot >= 0:
                    masks[slot, row] = 1
            self.lora_masks[:, :size].copy_(masks, non_blocking=True)
        key = (size, with_lora)
        graph = self.graphs.get(key)
        if graph is None:
            return self._forward(*key)[:n]
        graph.replay()
        return self.logits[key][:n]

    def _fill(self, buffer: torch.Tensor, values: list[int]) -> None:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
