"""Runs one scheduled step through the model.

The engine turns the scheduler's batch into a `StepInput` (`StepBuilder`): plain lists of token
ids, positions, the requests' places in the batch and what changed in their block tables,
small enough to send to every tensor-parallel rank each step. A `ModelRunner` (one per rank)
owns that rank's model shard and KV cache tensors, keeps the block tables as tensor rows, builds
the step's tensors and attention metadata, and returns the logits.

On CUDA it also sets the model up for the GPU: the Triton paged-attention kernels where they
measure faster than the torch reference (triton_attention.py), and decode steps replayed from
CUDA graphs (cuda_graphs.py) unless `enforce_eager`. Both read the cache tensors directly, so a
quantized KV cache keeps the reference attention; graphs also stay off across tensor-parallel
ranks (their collectives are not captured).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fleetllm.engine import cpu_attention, cpu_kernels, cpu_linear, kv_cache
from fleetllm.engine.attention import AttentionMetadata, build_metadata
from fleetllm.engine.block_manager import NULL_BLOCK, KVCacheManager
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from fleetllm.engine.kv_cache import KVCache
from fleetllm.engine.layer_ops import CpuLayerOps
from fleetllm.engine.lora_adapter import LoRAAdapter
from fleetllm.engine.lora_layers import lora_batch
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.request import Request
from fleetllm.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One step's batch, decodes first, then the prefill chunks (and the verification chunks
    of speculative decoding), in flattened token order."""

    token_ids: list[int]
    positions: list[int]
    decodes: list[tuple[str, int]]  # (request id, context length) per decode
    prefills: list[tuple[str, int, int]]  # (request id, computed before, query length)
    # Block-table changes since the step before: request id -> (first changed index, the ids
    # from there on); the table is then that long. Requests not in a step are forgotten.
    table_updates: dict[str, tuple[int, list[int]]]
    logits_indices: list[int]  # rows whose logits the step returns
    fresh_blocks: tuple[int, int]  # [start, stop) of block ids used for the first time
    # Each request's LoRA slot in request order (-1: the base model); None when no request of
    # the step has an adapter.
    lora_slots: list[int] | None = None
    # Adapters to copy into slots before the step runs (slot -> adapter).
    lora_loads: dict[int, LoRAAdapter] = field(default_factory=dict)

    @property
    def request_ids(self) -> list[str]:
        return [rid for rid, _ in self.decodes] + [rid for rid, _, _ in self.prefills]


@dataclass(frozen=True)
class PromptRows:
    """The logits rows after the sampled ones that score prompt tokens (prompt_logprobs):
    row j predicts prompt token `targets[j]` of request `requests[j]` at `positions[j]`."""

    requests: list[Request] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    def extend(self, other: PromptRows) -> None:
        self.requests.extend(other.requests)
        self.positions.extend(other.positions)


class StepBuilder:
    """Builds the `StepInput`s of one engine (its ranks see them in order), sending each
    request's block table whole once and then only what changed."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._sent: dict[str, list[int]] = {}  # request id -> the table as the ranks have it

    def build(
        self,
        batch: list[ScheduledRequest],
        fresh_blocks: range,
        lora_loads: dict[int, LoRAAdapter] | None = None,
    ) -> tuple[StepInput, list[ScheduledRequest], PromptRows]:
        """The step's input, the requests that sample, in the order of their logits rows
        (a request with draft tokens has one row per draft plus one), and the rows after
        those that score prompt tokens. `fresh_blocks`: the blocks to zero before the step
        writes any (`KVCacheManager.take_fresh_blocks`); `lora_loads`: adapters the ranks
        copy into their slots first (`LoRASlots.pending_loads`)."""
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for s in batch:
            is_decode = s.num_new_tokens == 1 and s.request.num_computed_tokens > 0
            (decodes if is_decode else prefills).append(s)
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        prompt_rows, prompt_indices = PromptRows(), []
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            known = s.num_new_tokens - len(s.spec_token_ids)
            ids.extend(s.request.all_token_ids[start : start + known])
            ids.extend(s.spec_token_ids)  # draft tokens follow the last known token
            positions.extend(range(start, start + s.num_new_tokens))
            req = s.request
            if req.needs_prompt_logprobs:
                # Position p's logits score prompt token p + 1; those not scored yet (a
                # preempted request computes its prefill again).
                first = max(start, len(req.prompt_logprobs or ()) - 1)
                last = min(start + known, req.num_prompt_tokens - 1)
                base = len(ids) - s.num_new_tokens - start
                prompt_indices.extend(base + p for p in range(first, last))
                prompt_rows.requests.extend([req] * max(0, last - first))
                prompt_rows.positions.extend(range(first, last))
            if s.samples:
                rows = 1 + len(s.spec_token_ids)
                logits_indices.extend(range(len(ids) - rows, len(ids)))
                sampled.append(s)
        step = StepInput(
            token_ids=ids,
            positions=positions,
            decodes=[(s.request.request_id, s.request.num_computed_tokens + 1) for s in decodes],
            prefills=[
                (s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens)
                for s in prefills
            ],
            table_updates=self._table_updates([s.request.request_id for s in batch]),
            logits_indices=logits_indices + prompt_indices,
            fresh_blocks=(fresh_blocks.start, fresh_blocks.stop),
            lora_loads=lora_loads or {},
        )
        slots = [s.request.lora_slot for s in decodes + prefills]
        if any(slot is not None for slot in slots):
            step.lora_slots = [-1 if slot is None else slot for slot in slots]
        return step, sampled, prompt_rows

    def _table_updates(self, request_ids: list[str]) -> dict[str, tuple[int, list[int]]]:
        updates: dict[str, tuple[int, list[int]]] = {}
        sent: dict[str, list[int]] = {}
        for rid in request_ids:
            table = self.kv.block_table(rid)
            before = self._sent.get(rid, [])
            same = min(len(before), len(table))
            if before[:same] != table[:same]:  # blocks replaced: after a preemption, say
                same = next(i for i in range(same) if before[i] != table[i])
            if same < len(table) or len(table) < len(before):
                updates[rid] = (same, table[same:])
            sent[rid] = list(table)  # the manager extends its list in place
        self._sent = sent
        return updates


class BlockTables:
    """A rank's block tables of the requests in flight, each a row of block ids (a tensor
    padded with the null block), changed each step by only what the step's input says."""

    def __init__(self, width: int) -> None:
        self.width = width  # blocks of the longest sequence
        self._rows: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (row, length)

    def update(self, request_id: str, first: int, block_ids: list[int]) -> None:
        row, length = self._rows.get(request_id) or (
            torch.full((self.width,), NULL_BLOCK, dtype=torch.long),
            0,
        )
        end = first + len(block_ids)
        if block_ids:
            row[first:end] = torch.tensor(block_ids, dtype=torch.long)
        if end < length:
            row[end:length] = NULL_BLOCK  # released blocks (rejected drafts' slots)
        self._rows[request_id] = (row, end)

    def row(self, request_id: str) -> torch.Tensor:
        return self._rows[request_id][0]

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every row but these (the requests of the current step)."""
        self._rows = {rid: self._rows[rid] for rid in request_ids if rid in self._rows}


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to turn into logits


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 1,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_tables = BlockTables(-(-max_model_len // block_size))
        # One extra block for the null block (id 0). The pool starts uninitialised, so the
        # operating system commits its memory only as blocks come into use; each block is
        # zeroed on its first use (see BlockPool), the null block right away. A tensor-
        # parallel rank holds its own KV heads only.
        slots = (num_blocks + 1) * block_size
        kv_heads = cfg.num_kv_heads // model.tp.size
        self.kv_caches: list[tuple[KVCache, KVCache]] = [
            (
                kv_cache.allocate(slots, kv_heads, cfg.head_dim, kv_cache_dtype, dtype, device),
                kv_cache.allocate(slots, kv_heads, cfg.head_dim, kv_cache_dtype, dtype, device),
            )
            for _ in range(cfg.num_layers)
        ]
        self._zero_blocks(range(NULL_BLOCK, NULL_BLOCK + 1))
        self.graphs: DecodeGraphs | None = None
        self.attention: dict[str, str] = {"decode": "torch", "prefill": "torch"}
        """The attention implementation of each phase, and why a Triton kernel fell back."""
        if device.type == "cuda" and kv_cache_dtype == "auto":
            self._setup_gpu(max_model_len, max_num_seqs, enforce_eager or model.tp.size > 1)
        elif device.type == "cpu":
            self._setup_cpu(cpu_attention.supported(dtype, device, kv_cache_dtype))

    def _setup_gpu(self, max_model_len: int, max_num_seqs: int, enforce_eager: bool) -> None:
        try:
            from fleetllm.engine import triton_attention
        except ImportError as error:
            log.warning("triton is not installed: attention runs on the torch reference")
            self.attention = {"decode": "torch", "prefill": "torch", "fallback": str(error)}
            return
        attn = self.model.attention
        k_cache, v_cache = self.kv_caches[0]
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        backend = triton_attention.measured_backend(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scale,
            k_cache,
            v_cache,
            self.block_size,
            self.num_blocks,
            max_model_len,
            max_num_seqs,
        )
        if backend.failures:
            # Once, at start-up: every step after this runs those phases on torch.
            log.warning(
                "triton kernel unavailable: attention falls back to the torch reference",
                extra={
                    "phases": sorted(backend.failures),
                    "error": next(iter(backend.failures.values())),
                },
            )
        if "decode" in backend.failures:
            # CUDA graphs replay the kernel's decode (fixed shapes); torch's runs eagerly.
            enforce_eager = True
        elif not enforce_eager:
            # A graph replays fixed shapes: the kernel's decode, reading whole table rows.
            backend.triton_decode = True
        self.model.set_attention(backend)
        self.attention = {
            "decode": "triton" if backend.triton_decode else "torch",
            "prefill": "triton" if backend.triton_prefill else "torch",
        }
        if backend.failures:
            self.attention["fallback"] = "; ".join(f"{k}: {v}" for k, v in backend.failures.items())
        log.info("attention backend", extra=dict(self.attention))
        if not enforce_eager:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,  # type: ignore[arg-type]  # plain tensors (checked above)
                self.block_size,
                self.block_tables.width,
                capture_sizes(max_num_seqs),
                self.device,
            )

    def _setup_cpu(self, attention_supported: bool) -> None:
        kernel = cpu_kernels.load_kernel()
        if kernel is None:
            log.info("attention backend", extra=dict(self.attention))
            return
        self.model.set_layer_ops(CpuLayerOps(kernel))
        if layers := cpu_linear.use_few_rows_kernel(self.model, kernel):
            log.info(
                "few-rows linear kernel", extra={"layers": layers, "rows": cpu_linear.FEW_ROWS}
            )
        if attention_supported:
            attn = self.model.attention
            self.model.set_attention(
                cpu_attention.CpuPagedAttention(
                    attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, kernel
                )
            )
            self.attention = {"decode": "cpu kernel", "prefill": "cpu kernel"}
        log.info("attention backend", extra=dict(self.attention))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(kv_cache.nbytes(k) + kv_cache.nbytes(v) for k, v in self.kv_caches)

    def _zero_blocks(self, blocks: range) -> None:
        if blocks:
            rows = slice(blocks.start * self.block_size, blocks.stop * self.block_size)
            for k_cache, v_cache in self.kv_caches:
                kv_cache.zero(k_cache, rows)
                kv_cache.zero(v_cache, rows)

    def prepare(self, step: StepInput) -> ModelInput:
        tables = self.block_tables
        for request_id, (first, block_ids) in step.table_updates.items():
            tables.update(request_id, first, block_ids)
        md = build_metadata(
            self.block_size,
            [(tables.row(rid), context) for rid, context in step.decodes],
            [(tables.row(rid), computed, qlen) for rid, computed, qlen in step.prefills],
            self.device,
        )
        tables.retain(step.request_ids)
        return ModelInput(
            input_ids=torch.tensor(step.token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(step.positions, dtype=torch.long, device=self.device),
            attn_metadata=md,
            logits_indices=torch.tensor(step.logits_indices, dtype=torch.long, device=self.device),
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Float32 logits [len(logits_indices), vocab]; None on tensor-parallel ranks other
        than 0."""
        if self.model.attention.reads_whole_blocks:
            self._zero_blocks(range(*step.fresh_blocks))
        lora = self.model.lora
        for slot, adapter in step.lora_loads.items():
            assert lora is not None, "a LoRA load in a model without LoRA"
            lora.load(slot, adapter)
        graphs = self.graphs
        if (
            graphs is not None
            and not step.prefills
            and len(step.decodes) <= graphs.max_size
            and step.logits_indices == list(range(len(step.decodes)))
        ):
            tables = self.block_tables
            for request_id, (first, block_ids) in step.table_updates.items():
                tables.update(request_id, first, block_ids)
            tables.retain(step.request_ids)
            return graphs.run(
                step.token_ids,
                step.positions,
                [tables.row(rid) for rid, _ in step.decodes],
                [context for _, context in step.decodes],
                step.lora_slots,
            )
        inp = self.prepare(step)
        if step.lora_slots is not None:
            assert lora is not None, "a LoRA step in a model without LoRA"
            query_lens = [1] * len(step.decodes) + [qlen for _, _, qlen in step.prefills]
            lora.batch = lora_batch(step.lora_slots, query_lens, self.device)
        try:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
        finally:
            if lora is not None:
                lora.batch = None
        return self.model.compute_logits(hidden[inp.logits_indices])
