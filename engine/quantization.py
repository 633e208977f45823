"""Weight-only quantization: int8 everywhere, fp8 (e4m3) on GPUs that have it.

Each weight matrix is stored in one byte per value with one scale per output channel
(symmetric absmax: the row's largest magnitude maps onto 127, or 448 for e4m3); activations
stay in the model dtype. Every projection is quantized, and so is the embedding: its rows are
the LM head's output channels, so a tied head shares the quantized matrix and its scales.
Norms and biases stay in the model dtype.

Quantizing swaps modules after loading, the way `cpu_linear` swaps in packed linears: a
`QuantizedLinear` has `nn.Linear`'s call, a `QuantizedEmbedding` the embedding's.
"""

from __future__ import annotations

import torch
from torch import nn

from fleetllm.engine.config import QUANTIZATION_METHODS
from fleetllm.engine.kv_cache import fp8_supported
from fleetllm.engine.model import LlamaForCausalLM, VocabParallelEmbedding

_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max)}
# CPU kernels for int8 weights with half-precision activations (one fused dequantizing matmul);
# with float32 activations the kernel is slower than dequantizing first.
_INT8_MM_DTYPES = (torch.bfloat16, torch.float16)


def check_quantization(method: str | None, device: torch.device) -> None:
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {method!r} is not supported; use {', '.join(QUANTIZATION_METHODS)} "
            "or leave it unset"
        )
    if method == "fp8" and not fp8_supported(device):
        raise ValueError(
            "quantization='fp8' needs a CUDA GPU with fp8 support (compute capability 8.9 or "
            "newer: Ada, Hopper); use quantization='int8' here"
        )


def quantize_rows(
    weight: torch.Tensor, method: str, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (one byte per value [out, in], a scale per row [out] in `scale_dtype`)."""
    qdtype = _STORAGE[method]
    qmax = _QMAX[qdtype]
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = w / scale[:, None]
    if qdtype == torch.int8:
        q = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp_(-qmax, qmax).to(qdtype)
    return q, scale.to(scale_dtype)


class QuantizedLinear(nn.Module):
    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qweight, scale = self.qweight, self.scale
        if qweight.dtype == torch.int8 and x.device.type == "cpu" and x.dtype in _INT8_MM_DTYPES:
            flat = x.reshape(-1, self.in_features)
            y = torch.ops.aten._weight_int8pack_mm(flat, qweight, scale)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            # Per-output-channel scales commute with the matmul: scale after it.
            y = nn.functional.linear(x, qweight.to(x.dtype)) * scale
        return y if self.bias is None else y + self.bias


class QuantizedEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding over a quantized matrix: rows dequantize on lookup."""

    def __init__(self, base: VocabParallelEmbedding, qweight: torch.Tensor, scale: torch.Tensor):
        nn.Module.__init__(self)
        self.tp = base.tp
        self.vocab_start, self.vocab_end = base.vocab_start, base.vocab_end
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[local_ids].to(self.scale.dtype)
        return rows * self.scale[local_ids, None]


@torch.inference_mode()
def quantize_model(model: LlamaForCausalLM, method: str) -> int:
    """Quantize every projection, the embedding and the LM head of a loaded model, in place;
    returns how many matrices."""
    embed = model.model.embed_tokens
    dtype = embed.weight.dtype
    tied = model.lm_head.weight is embed.weight
    qembed, embed_scale = quantize_rows(embed.weight, method, dtype)
    model.model.embed_tokens = QuantizedEmbedding(embed, qembed, embed_scale)
    count = 1
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child is model.lm_head and tied:
                replacement = QuantizedLinear(qembed, embed_scale, None)
            else:
                qweight, scale = quantize_rows(child.weight, method, dtype)
                replacement = QuantizedLinear(qweight, scale, child.bias)
                count += 1
            setattr(module, name, replacement)
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held in memory: parameters and weight buffers, each
    shared tensor once; the RoPE tables (derived, not weights) are not counted."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
