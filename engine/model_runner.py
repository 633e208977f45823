"""Runs one scheduled step through the model: builds the flattened batch and its attention
metadata, owns the KV cache tensors, and returns the logits of the rows to sample."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fleetllm.engine.attention import AttentionMetadata, build_metadata
from fleetllm.engine.block_manager import NULL_BLOCK, KVCacheManager
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.scheduler import ScheduledRequest


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
            is_decode = s.num_new_tokens == 1 and s.request.num_computed_tokens > 0
            (decodes if is_decode else prefills).append(s)
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
        inp = self.prepare(batch)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
        return self.model.compute_logits(hidden[inp.logits_indices]), inp.sampled
