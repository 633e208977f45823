"""Weight-only quantization: int8 everywhere, fp8 (e4m3) on GPUs that have it.

Each weight matrix is stored in one byte per value; activations stay in the model dtype.
- int8: a scale and an offset per group of `sizing.INT8_GROUP` (32) inputs of each output
  channel (asymmetric: the group's minimum maps onto -128, its maximum onto 127), both in 16 bits.
  A scale per whole row adds a rounding step as wide as the row's largest value to every small
  weight, enough to flip several percent of a small model's next tokens; per group of 32 the
  step follows the local range (and GGUF's 4- and 8-bit block formats, blocks of 32, come back
  almost exactly). A row whose length 32 does not divide is one group.
- fp8: one scale per output channel (e4m3 is floating point: its step already follows the
  value).
Every projection is quantized, and so is the embedding: its rows are the LM head's output
channels, so a tied head shares the quantized matrix and its scales. Norms and biases stay in
the model dtype.

Quantizing swaps modules after loading, the way `cpu_linear` swaps in packed linears: a
`QuantizedLinear` has `nn.Linear`'s call, a `QuantizedEmbedding` the embedding's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fleetllm.engine.config import QUANTIZATION_METHODS
from fleetllm.engine.kv_cache import fp8_supported
from fleetllm.engine.model import LlamaForCausalLM, VocabParallelEmbedding
from fleetllm.engine.sizing import int8_group

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_INF = torch.tensor(float("inf"))


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


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit type (sizing.WEIGHT_SCALE_BYTES) of the scales and offsets of a model in
    `dtype`."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


@dataclass(frozen=True)
class QuantizedMatrix:
    """An [out, in] weight in one byte per value, held input-major: values [in, out], and a
    scale per group of `group` inputs of each output channel, [groups, out]; int8 also has an
    offset [groups, out] (weight = value * scale + offset). Input-major, the scales broadcast
    along the contiguous output dimension, which makes dequantizing a plain vector loop."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.values.shape[0] // self.scale.shape[0]

    def dequantize(self, dtype: torch.dtype, channels: torch.Tensor | None = None) -> torch.Tensor:
        """The weight transposed, [in, out] (only the output `channels` if given), in `dtype`."""
        values, scale, offset = self.values, self.scale, self.offset
        if channels is not None:
            values, scale = values[:, channels], scale[:, channels]
            offset = None if offset is None else offset[:, channels]
        inputs, out = values.shape
        grouped = values.view(scale.shape[0], self.group, out).to(dtype)
        scale = scale[:, None].to(dtype)
        if offset is None:
            return (grouped * scale).view(inputs, out)
        return torch.addcmul(offset[:, None].to(dtype), grouped, scale).view(inputs, out)


def quantize_matrix(weight: torch.Tensor, method: str) -> QuantizedMatrix:
    """[out, in] -> its quantized form; scales (and offsets) in the 16-bit type that suits the
    weight's dtype."""
    w = weight.detach().to(torch.float32)
    out, columns = w.shape
    dtype = scale_dtype(weight.dtype)
    if method == "fp8":
        scale = w.abs().amax(dim=1, keepdim=True) / _FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(dtype)
        values = (w / scale.float()).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8)
        return QuantizedMatrix(values.t().contiguous(), scale.t().contiguous(), None)
    group = int8_group(columns)
    grouped = w.view(out, columns // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    # Scale and offset are rounded to 16 bits first and the values quantized against them;
    # the scale rounds up, so that the group's range still fits in 256 steps.
    exact = (high - low) / 255
    scale = exact.to(dtype)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, _INF.to(dtype)), scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    offset = (low + 128 * scale.float()).to(dtype)
    values = (grouped - offset.float()[..., None]) / scale.float()[..., None]
    values = values.round_().clamp_(-128, 127).to(torch.int8).view(out, columns)
    return QuantizedMatrix(values.t().contiguous(), scale.t().contiguous(), offset.t().contiguous())


# Elements of one dequantized slice of a weight: it stays in the CPU's cache between being
# written and being multiplied, and no matrix-sized buffer is allocated per call.
DEQUANTIZE_CHUNK = 1 << 20


class QuantizedLinear(nn.Module):
    def __init__(self, matrix: QuantizedMatrix, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = matrix.values.shape
        self.register_buffer("qweight", matrix.values)
        self.register_buffer("scale", matrix.scale)
        self.register_buffer("offset", matrix.offset)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset is None:
            # One scale per output channel commutes with the matmul: scale after it.
            y = (x @ self.qweight.to(x.dtype)) * self.scale[0].to(x.dtype)
        else:
            y = self._grouped_matmul(x)
        return y if self.bias is None else y + self.bias

    def _grouped_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ the dequantized weight, a slice of output channels at a time."""
        # Half-precision arithmetic on a CPU converts each element to float32 and back, which
        # costs more than the matmul saves: dequantize and multiply in float32 there.
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        flat = x.reshape(-1, self.in_features).to(compute)
        step = max(1, DEQUANTIZE_CHUNK // self.in_features)
        scratch = torch.empty(
            self.in_features * min(step, self.out_features), dtype=compute, device=x.device
        )
        groups = self.scale.shape[0]
        parts = []
        for start in range(0, self.out_features, step):
            cols = slice(start, start + step)
            n = min(step, self.out_features - start)
            w = scratch[: self.in_features * n].view(groups, -1, n)
            w.copy_(self.qweight[:, cols].view(groups, -1, n))
            w.mul_(self.scale[:, None, cols]).add_(self.offset[:, None, cols])
            parts.append(flat @ w.view(self.in_features, n))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class QuantizedEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding over a quantized matrix: rows dequantize on lookup."""

    def __init__(self, base: VocabParallelEmbedding, matrix: QuantizedMatrix, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.tp = base.tp
        self.vocab_start, self.vocab_end = base.vocab_start, base.vocab_end
        self.dtype = dtype
        self.register_buffer("qweight", matrix.values)
        self.register_buffer("scale", matrix.scale)
        self.register_buffer("offset", matrix.offset)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        matrix = QuantizedMatrix(self.qweight, self.scale, self.offset)
        rows = matrix.dequantize(self.dtype, local_ids.reshape(-1)).t()
        return rows.reshape(*local_ids.shape, rows.shape[-1])


@torch.inference_mode()
def quantize_model(model: LlamaForCausalLM, method: str) -> int:
    """Quantize every projection, the embedding and the LM head of a loaded model, in place;
    returns how many matrices."""
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    qembed = quantize_matrix(embed.weight, method)
    model.model.embed_tokens = QuantizedEmbedding(embed, qembed, embed.weight.dtype)
    count = 1
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child is model.lm_head and tied:
                replacement = QuantizedLinear(qembed, None)
            else:
                replacement = QuantizedLinear(quantize_matrix(child.weight, method), child.bias)
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
