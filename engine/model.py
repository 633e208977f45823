"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain PyTorch over a paged KV cache.

Parameter names follow Hugging Face's checkpoints so weights load by name. The numerics follow
Hugging Face's implementation operation for operation (norms in float32, RoPE tables in float32
cast to the model dtype) so greedy decoding matches it token for token.

The model works on a flattened batch: `input_ids` and `positions` are [num_tokens], mixing
prefill chunks and decodes; attention is delegated to an attention backend that reads the
step's `AttentionMetadata`.

Under tensor parallelism (`parallel.TensorParallel`) every module is built with this rank's
share of the heads, the MLP and the vocabulary; the loader fills in the matching shard.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.kv_cache import KVCache
from fleetllm.engine.layer_ops import RopeContext, TorchLayerOps
from fleetllm.engine.parallel import TensorParallel

if TYPE_CHECKING:
    from fleetllm.engine.lora_layers import LoRAState


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = TorchLayerOps()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); `layer_ops.TorchLayerOps.rms_norm`."""
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the config's RoPE variant,
    computed on the CPU whatever the ambient device (see `RotaryEmbedding`)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = int(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    The tables are computed on the CPU even while the model is built on the meta device (as the
    loader builds it): they are not in any checkpoint, and arithmetic on meta tensors goes
    through torch's Python reference ops, whose first use imports torch._dynamo (seconds of a
    cold start)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

        self.ops = TorchLayerOps()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeContext:
        """What the layers' rotary embedding needs for the step's positions, computed once
        per step and shared by every layer."""
        return self.ops.rope_context(self.cos, self.sin, positions, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        # q, k and v in one matmul: the checkpoint's q_proj/k_proj/v_proj stacked by rows
        # (this rank's heads of each). o_proj takes this rank's heads' columns.
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.attn = TorchPagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)
        self.ops = TorchLayerOps()

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeContext,
        kv_cache: tuple[KVCache, KVCache],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = self.ops.rotary(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], md)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        h, i = cfg.hidden_size, cfg.intermediate_size // tp.size
        self.intermediate_size = i
        # gate and up in one matmul: the checkpoint's gate_proj/up_proj stacked by rows
        # (this rank's slice of each); down_proj takes the slice's columns.
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.ops = TorchLayerOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class VocabParallelEmbedding(nn.Module):
    """Token embeddings; under tensor parallelism each rank holds the rows of its share of
    the vocabulary, looks up the ids that fall in it (zeros elsewhere), and the ranks' rows
    are summed."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end, rows = tp.vocab_split(cfg.vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = self.lookup((input_ids - self.vocab_start) * inside)
        return self.tp.all_reduce(rows * inside[:, None].to(rows.dtype))

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(local_ids, self.weight)


# Checkpoint tensors that load as row slices of one fused parameter:
# checkpoint module name -> (fused module name, slice index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeContext,
        kv_cache: tuple[KVCache, KVCache],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it is added (the next norm adds
        it: one pass instead of two); the first layer gets no residual."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[KVCache, KVCache]],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv, md)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.model = LlamaModel(cfg, max_positions, tp)
        # Vocab-parallel: this rank's vocabulary rows, as the embedding.
        _, _, vocab_rows = tp.vocab_split(cfg.vocab_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The LoRA slots, when the projections are wrapped for adapters (lora_layers).
        self.lora: LoRAState | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[KVCache, KVCache]],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        return self.model(input_ids, positions, kv_caches, md)

    @property
    def attention(self) -> TorchPagedAttention:
        """The layers' attention backend (one for all: `set_attention`), over this rank's
        heads."""
        return self.model.layers[0].self_attn.attn

    def set_attention(self, backend: TorchPagedAttention) -> None:
        """Run every layer's attention on `backend` (a faster implementation, same results)."""
        for layer in self.model.layers:
            layer.self_attn.attn = backend

    def set_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the layers' elementwise steps on `ops` (a faster implementation, same
        results)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | RotaryEmbedding | Attention | MLP):
                module.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits for the given rows (computed in the model dtype, as HF does); under
        tensor parallelism gathered on rank 0, and None on the other ranks."""
        logits = self.tp.gather_last_dim(self.lm_head(hidden))
        if logits is None:
            return None
        return logits[:, : self.config.vocab_size].float()
