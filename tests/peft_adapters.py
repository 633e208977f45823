"""Seeded random LoRA adapters in PEFT's format (adapter_config.json and
adapter_model.safetensors), made with `peft` as users make theirs, for a Hugging Face model
folder. The base weights are random: an adapter's files depend only on the base's shapes."""

from __future__ import annotations

from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora(model_dir: Path, out: Path, *, seed: int = 0, r: int = 8) -> Path:
    """A rank-`r` adapter of every projection of the model at `model_dir`, saved in `out`."""
    import peft
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    lora = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=list(PROJECTIONS), init_lora_weights=False
    )
    peft.get_peft_model(base, lora).save_pretrained(out, safe_serialization=True)
    return out
