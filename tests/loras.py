"""LoRA adapters for tests: seeded random PEFT adapters of a Hugging Face model (saved in PEFT's
format, with the merged model as the reference), and adapter folders written tensor by tensor
for the checks of what a corrupt adapter is refused for."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.lora_adapter import module_shape

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base: torch.nn.Module,
    path: Path,
    seed: int,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    b_std: float = 0.02,
    **config: Any,
) -> torch.nn.Module:
    """Save a seeded random LoRA of `base` (left unchanged) under `path` with PEFT, on every
    projection unless `target_modules` says otherwise; returns `base` with the adapter merged
    (PEFT's `merge_and_unload`), the reference. A is drawn so that A @ x is about the size of
    x; B (which PEFT starts at zero) with `b_std`, so the adapter changes the outputs."""
    import peft

    config.setdefault("target_modules", list(ALL_MODULES))
    lora_config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, init_lora_weights=False, **config)
    model = peft.get_peft_model(copy.deepcopy(base), lora_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * b_std)
    model.save_pretrained(path, safe_serialization=True)
    return model.merge_and_unload().eval()


def adapter_tensors(
    cfg: dict[str, Any], r: int, modules: tuple[str, ...] = ALL_MODULES, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random lora_A/lora_B tensors of every layer, named as PEFT names them."""
    g = torch.Generator().manual_seed(seed)
    model = ModelConfig.from_dict(cfg)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            inputs, outputs = module_shape(model, module)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((r, inputs), generator=g)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((outputs, r), generator=g)
    return tensors


def write_adapter(
    path: Path,
    tensors: dict[str, torch.Tensor],
    r: int,
    modules: tuple[str, ...] = ALL_MODULES,
    **config: Any,
) -> Path:
    """An adapter folder as PEFT writes it, from given tensors and config fields."""
    path.mkdir(parents=True, exist_ok=True)
    body = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": list(modules),
        "bias": "none",
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(body))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
