"""Runs one scheduled step through the model: builds the flattened batch and its attention
metadata, owns the KV cache tensors, and returns the logits of the rows to sample.

On CUDA it also sets the model up for the GPU: the Triton paged-attention kernels where they
measure faster than the torch reference (triton_attention.py), and decode steps replayed from
CUDA graphs (cuda_graphs.py) unless `enforce_eager`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fleetllm.engine.attention import AttentionMetadata, build_metadata
from fleetllm.engine.block_manager import NULL_BLOCK, KVCacheManager
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


class BlockTables:
    """The block tables of the requests in flight, each a row of block ids (a tensor padded
    with the null block), extended each step by only the blocks its request gained."""

    def __init__(self, kv: KVCacheManager, width: int) -> None:
        self.kv = kv
        self.width = width  # blocks of the longest sequence
        # request id -> (the block manager's live id list, row, ids written to the row)
        self._rows: dict[str, tuple[list[int], torch.Tensor, int]] = {}

    def row(self, request_id: str) -> torch.Tensor:
        ids = self.kv.block_table(request_id)
        entry = self._rows.get(request_id)
        if entry is None or entry[0] is not ids:  # new, or freed and allocated again
            entry = (ids, torch.full((self.width,), NULL_BLOCK, dtype=torch.long), 0)
        _, row, written = entry
        if len(ids) > written:
            row[written : len(ids)] = torch.tensor(ids[written:], dtype=torch.long)
            entry = (ids, row, len(ids))
        self._rows[request_id] = entry
        return row

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every row but these (the requests of the current step)."""
        self._rows = {rid: self._rows[rid] for rid in request_ids if rid in self._rows}


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to turn into logits
    sampled: list[ScheduledRequest]  # in the order of logits_indices


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        kv: KVCacheManager,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int = 1,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.block_tables = BlockTables(kv, kv.blocks_needed(max_model_len))
        # One extra block for the null block (id 0). The pool starts uninitialised, so the
        # operating system commits its memory only as blocks come into use; each block is
        # zeroed on its first use (see BlockPool), the null block right away.
        self.block_size = kv.block_size
        slots = (kv.num_blocks + 1) * kv.block_size
        shape = (slots, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        self._zero_blocks(range(NULL_BLOCK, NULL_BLOCK + 1))
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda":
            self._setup_gpu(max_model_len, max_num_seqs, enforce_eager)

    def _setup_gpu(self, max_model_len: int, max_num_seqs: int, enforce_eager: bool) -> None:
        try:
            from fleetllm.engine import triton_attention
        except ImportError:
            log.warning("triton is not installed: attention runs on the torch reference")
            return
        attn = self.model.model.layers[0].self_attn.attn  # this device's heads
        k_cache, v_cache = self.kv_caches[0]
        backend = triton_attention.measured_backend(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scale,
            k_cache,
            v_cache,
            self.block_size,
            self.kv.num_blocks,
            max_model_len,
            max_num_seqs,
        )
        if not enforce_eager:
            # A graph replays fixed shapes: the kernel's decode, reading whole table rows.
            backend.triton_decode = True
        self.model.set_attention(backend)
        log.info(
            "attention backend",
            extra={
                "decode": "triton" if backend.triton_decode else "torch",
                "prefill": "triton" if backend.triton_prefill else "torch",
            },
        )
        if not enforce_eager:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                self.block_tables.width,
                capture_sizes(max_num_seqs),
                self.device,
            )

    def _zero_blocks(self, blocks: range) -> None:
        if blocks:
            rows = slice(blocks.start * self.block_size, blocks.stop * self.block_size)
            for k_cache, v_cache in self.kv_caches:
                k_cache[rows].zero_()
                v_cache[rows].zero_()

    def prepare(self, batch: list[ScheduledRequest]) -> ModelInput:
        """Order the batch decodes-first and describe it for the model."""
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for s in batch:
            (decodes if _is_decode(s) else prefills).append(s)
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            if s.samples:
                logits_indices.append(len(ids) - 1)
                sampled.append(s)
        tables = self.block_tables
        md = build_metadata(
            self.kv.block_size,
            [
                (tables.row(s.request.request_id), s.request.num_computed_tokens + 1)
                for s in decodes
            ],
            [
                (
                    tables.row(s.request.request_id),
                    s.request.num_computed_tokens,
                    s.num_new_tokens,
                )
                for s in prefills
            ],
            self.device,
        )
        tables.retain(s.request.request_id for s in batch)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn_metadata=md,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            sampled=sampled,
        )

    def execute(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Float32 logits [num_sampled, vocab] and the requests they belong to."""
        self._zero_blocks(self.kv.take_fresh_blocks())
        graphs = self.graphs
        if (
            graphs is not None
            and len(batch) <= graphs.max_size
            and all(_is_decode(s) and s.samples for s in batch)
        ):
            reqs = [s.request for s in batch]
            tables = [self.block_tables.row(r.request_id) for r in reqs]
            self.block_tables.retain(r.request_id for r in reqs)
            logits = graphs.run(
                [r.all_token_ids[r.num_computed_tokens] for r in reqs],
                [r.num_computed_tokens for r in reqs],
                tables,
                [r.num_computed_tokens + 1 for r in reqs],
            )
            return logits, batch
        inp = self.prepare(batch)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
        return self.model.compute_logits(hidden[inp.logits_indices]), inp.sampled


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.request.num_computed_tokens > 0
