"""Loads Hugging Face safetensors checkpoints (single file or sharded) into the model.

Under tensor parallelism each rank reads only its shard of every tensor (safetensors slices),
so no rank ever holds the whole model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.cpu_linear import pack_linear_layers, packing_supported
from fleetllm.engine.model import STACKED_PARAMS, LlamaForCausalLM
from fleetllm.engine.parallel import TensorParallel

log = logging.getLogger(__name__)

# Checkpoint entries that carry no weights of ours (older exports saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        # Shards are files of this folder: a path in the index (`../`) would read outside it.
        outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
        if outside:
            raise ValueError(f"{index} names shards outside the model folder: {outside[:5]}")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    batch_hint: int = 1,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    pack: bool = True,
) -> LlamaForCausalLM:
    """`batch_hint`: the usual number of rows per forward (the decode batch), for kernels that
    lay their weights out for a batch size. `load_format="dummy"` (vLLM's name) reads no
    checkpoint: the weights are random, for benchmarks of a model's shapes. `tp`: this rank's
    shard (default: all of it). `pack`: reorder the linears for oneDNN where it runs `dtype`
    (`sizing.packs_linears` says when: on a CPU, unless quantization replaces them)."""
    tp = tp or TensorParallel()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp)
    if load_format == "dummy":
        _random_weights(model, dtype, device)
    else:
        _load_checkpoint(model, model_dir, cfg, dtype, device, tp)
    # The RoPE tables are not in the checkpoint: the model computed them on the CPU.
    model.model.rotary.to(device)
    model.eval()
    packed = 0
    if pack and packing_supported(dtype, device):
        packed = pack_linear_layers(model, batch_hint)
    log.info(
        "loaded model",
        extra={
            "model_dir": str(model_dir),
            "dtype": str(dtype),
            "load_format": load_format,
            "packed_linears": packed,
            "tensor_parallel_rank": tp.rank,
            "tensor_parallel_size": tp.size,
        },
    )
    return model


@torch.inference_mode()
def _random_weights(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Allocated straight in `dtype` on `device` (no float32 copy of a large model), drawn
    from a fixed seed: norms 1, everything else N(0, 0.02). The RoPE tables are computed, not
    drawn: they stay as the model built them, in float32."""
    rotary = model.model.rotary
    del model.model.rotary  # out of the casts below, which would convert and blank it too
    model.to(dtype).to_empty(device=device)
    model.model.rotary = rotary
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _load_checkpoint(
    model: LlamaForCausalLM,
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
) -> None:
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    weights: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}  # fused parameter -> its slices
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                target, index = _fused_target(name)
                if target not in expected:
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for this model")
                tensor = _read_shard(f, name, cfg, tp).to(device=device, dtype=dtype)
                if index is None:
                    weights[target] = tensor
                else:
                    parts.setdefault(target, {})[index] = tensor
    for target, slices in parts.items():
        want = 3 if ".qkv_proj." in target else 2
        if sorted(slices) != list(range(want)):
            raise ValueError(f"checkpoint in {model_dir} lacks parts of {target!r}")
        weights[target] = torch.cat([slices[i] for i in range(want)], dim=0)
    missing = sorted(expected - set(weights))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors: {shown}")
    for name, tensor in weights.items():
        want_shape = model.get_parameter(name).shape
        if tensor.shape != want_shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want_shape)}"
            )
    model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


# How each checkpoint tensor splits under tensor parallelism, by module name: "rows" splits the
# output dimension evenly (column-parallel), "columns" the input dimension (row-parallel),
# "vocab" the rows by vocabulary share. Anything else (norms) is replicated.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def _read_shard(f: object, name: str, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, read without loading the rest."""
    if tp.size == 1:
        return f.get_tensor(name)  # type: ignore[attr-defined]
    module_path, _, leaf = name.rpartition(".")
    module = module_path.rpartition(".")[2]
    tensor = f.get_slice(name)  # type: ignore[attr-defined]
    rows = tensor.get_shape()[0]
    if module in _COLUMN_PARALLEL:
        start, end = tp.split(rows)
        return tensor[start:end]
    if module in _ROW_PARALLEL:
        if leaf == "bias":
            # Added once: the ranks' partial outputs are summed, so only rank 0 adds it.
            full = tensor[:]
            return full if tp.rank == 0 else torch.zeros_like(full)
        start, end = tp.split(tensor.get_shape()[1])
        return tensor[:, start:end]
    if module in _VOCAB_PARALLEL:
        start, end, shard_rows = tp.vocab_split(cfg.vocab_size)
        part = tensor[start:end]
        if part.shape[0] < shard_rows:
            padding = part.new_zeros((shard_rows - part.shape[0], *part.shape[1:]))
            part = torch.cat([part, padding])
        return part
    return tensor[:]


def _fused_target(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (our parameter name, slice index within it or None)."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in STACKED_PARAMS:
        fused, index = STACKED_PARAMS[module]
        return f"{parent}.{fused}.{leaf}", index
    return name, None
