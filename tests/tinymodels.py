"""Random-weight tiny Llama-family checkpoints, written in Hugging Face layout for tests.

The weights are drawn with a larger spread than a real initialisation so that next-token
logits have clear winners: greedy comparisons then test the implementation, not float noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fleetllm.api.catalog import ModelArch
    from fleetllm.engine.engine import LLMEngine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# name -> (model_type, overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("llama", {}),
    "llama-gqa-tied": (
        "llama",
        {
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "hidden_size": 96,
            "tie_word_embeddings": True,
        },
    ),
    "llama-odd": (
        "llama",
        {
            "hidden_size": 70,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
            "intermediate_size": 130,
        },
    ),
    "llama3-rope": (
        "llama",
        {
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2-bias": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "mistral-headdim": (
        "mistral",
        {"num_key_value_heads": 2, "head_dim": 24, "sliding_window": None},
    ),
}


def build_hf_model(model_type: str, overrides: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[model_type]
    config = config_cls(**{**BASE, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 * 4)
    return model


def write_tiny_model(
    path: Path, variant: str, seed: int = 0, max_shard_size: str | None = None
) -> tuple[Path, torch.nn.Module]:
    """Save a tiny model under `path`; returns the directory and the HF model (float32)."""
    model_type, overrides = VARIANTS[variant]
    model = build_hf_model(model_type, overrides, seed)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    return path, model


def arch_of(model_dir: Path) -> ModelArch:
    """The catalog's shape of a checkpoint, from its config as the engine reads it."""
    from fleetllm.api.catalog import ModelArch
    from fleetllm.engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    return ModelArch(
        name=model_dir.name,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        intermediate_size=cfg.intermediate_size,
        tied_embeddings=cfg.tie_word_embeddings,
        qkv_bias=cfg.qkv_bias,
    )


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy `generate`, the correctness oracle."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            # Explicit, or generate would mask out prompt tokens equal to pad_token_id.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_tiny_chat_model(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Llama that speaks SmolLM2's tokenizer and chat template.

    Fast enough to start many engine processes in a test, while prompts and outputs are real
    text. Its outputs are gibberish, but deterministic under greedy decoding.
    """
    import shutil

    from fleetllm.engine.model_files import resolve_model

    smollm2 = resolve_model("smollm2-135m")
    settings = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **overrides,
    }
    model = build_hf_model("llama", settings, seed)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2 / name, path / name)
    return path


def float32_engine(model: Path | str, **config: Any) -> LLMEngine:
    """An engine over a tiny model, without its tokenizer (requests give token ids), in
    float32 (exact against references), with `config`'s pool and limits."""
    from fleetllm.engine.config import EngineConfig
    from fleetllm.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=str(model), dtype="float32", skip_tokenizer_init=True, **config)
    )
