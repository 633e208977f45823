"""Model and engine configuration.

`ModelConfig` is the engine's view of a Hugging Face `config.json` for the Llama family
(Llama 2/3, Mistral, Qwen2, SmolLM2). `EngineConfig` holds the knobs of one engine instance.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetllm.engine import cpu_features, sizing
from fleetllm.engine.scheduling_policy import DEFAULT_POLICY as DEFAULT_SCHEDULING_POLICY
from fleetllm.engine.scheduling_policy import POLICIES as SCHEDULING_POLICIES
from fleetllm.kv_events import KVEventsConfig, parse_kv_events_config

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = str(cfg.get("model_type", "llama"))
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"model_type {arch!r} is not supported; supported: {supported}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks required field {exc.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        # Checkpoints state RoPE either as rope_theta + rope_scaling (older exports) or as one
        # rope_parameters mapping that also carries rope_theta (newer ones).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = {**rope, "rope_type": rope_type} if rope_type != "default" else None
        # Qwen2 puts a bias on q/k/v only; Llama's `attention_bias` covers q/k/v and o.
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = arch == "qwen2" or attention_bias
        sliding_window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a config.json")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def context_limit(self, requested: int | None) -> int:
        """max_model_len: the one requested, checked against the model's positions, or
        those."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            # The reference attention has no sliding window; within the window it is exact.
            limit = min(limit, self.sliding_window)
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's limit of {limit} positions"
            )
        return requested

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers, in an unquantized cache."""
        return sizing.kv_bytes_per_token(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kv_cache_dtype="auto",
            dtype_bytes=dtype.itemsize,
        )


def check_kv_pool(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """A KV cache must hold at least one sequence of the full length."""
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens "
            f"({num_blocks} blocks of {block_size}), fewer than max_model_len="
            f"{max_model_len}: give it more blocks or lower max_model_len"
        )


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why. An explicit name is taken as given. `auto` picks the
    fastest dtype the device computes natively:

    - on the CPU, bfloat16 where its matrix units take bfloat16 operands (AVX512-BF16, AMX),
      else float32, whatever the checkpoint's dtype: elsewhere every bfloat16 or float16
      matmul converts its operands to float32 and runs several times slower than float32;
    - on a GPU, the checkpoint's dtype, float32 checkpoints served in bfloat16 the way released
      checkpoints are trained, and float16 where the device has no bfloat16.
    """
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not supported; use auto, {', '.join(DTYPES)}")
        return DTYPES[name], "as configured"
    if device.type == "cpu":
        flags = cpu_features.describe()
        if cpu_features.native_bf16():
            return torch.bfloat16, f"the CPU computes bfloat16 natively ({flags})"
        if cpu_features.native_bf16(isa_cap=""):
            cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
            return torch.float32, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off bfloat16 ({flags})"
        return torch.float32, f"the CPU has no native bfloat16 ({flags})"
    declared = (model.torch_dtype or "bfloat16").replace("torch.", "")
    dtype = DTYPES.get(declared, torch.bfloat16)
    if dtype == torch.float32:
        dtype = torch.bfloat16
    if dtype == torch.bfloat16 and not _device_has_bf16(device):
        return torch.float16, "the checkpoint's dtype; the device has no bfloat16"
    return dtype, "the checkpoint's dtype"


def _device_has_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return True


# vLLM's accepted values of max_lora_rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

QUANTIZATION_METHODS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
# Each decode step searches the context for every n-gram length up to this: bounded so a
# client's value cannot make the search cost grow with it (the CRD has the same bound).
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": m, "prompt_lookup_min": n}`. Without either lookup bound both are 5;
    with one, the other takes its value (vLLM's defaults)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """A config from a mapping or its JSON text; None or an empty mapping turns it off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        if not value:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported; use "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = _positive_int(value, "num_speculative_tokens", None)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {k}"
            )
        high = value.get("prompt_lookup_max")
        low = value.get("prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        high = _positive_int(value, "prompt_lookup_max", low)
        low = _positive_int(value, "prompt_lookup_min", high)
        if high > MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, "
                f"got {high}"
            )
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})"
            )
        return cls(method, k, high, low)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }


def _positive_int(value: dict[str, Any], key: str, default: int | None) -> int:
    got = value.get(key, default)
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {got!r}")
    return got


@dataclass
class EngineConfig:
    """One engine instance's settings; defaults follow vLLM's where a counterpart exists."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # None: the device's (step_token_budget)
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # scheduling_policy.py
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None
    # CPU, one rank: fewer threads while other processes take cores (cpu_threads.py).
    adaptive_threads: bool = True
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False  # CUDA: no decode graphs
    load_format: str = "auto"  # "dummy": random weights of the checkpoint's shapes
    tensor_parallel_size: int = 1
    quantization: str | None = None  # weight-only: int8, or fp8 on GPUs that have it
    kv_cache_dtype: str = "auto"  # auto (the model dtype), int8, or fp8 on such GPUs
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = field(default=None)
    kv_events_config: KVEventsConfig | str | None = None  # vLLM's --kv-events-config JSON
    # LoRA adapters (vLLM's names and defaults): device slots, the largest rank, and how many
    # adapters' weights stay in CPU memory (default: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def step_token_budget(self) -> int:
        """max_num_batched_tokens, or where it is not given the device's default (sizing)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return sizing.default_max_num_batched_tokens(self.device)

    @property
    def publishes_kv_events(self) -> bool:
        return isinstance(self.kv_events_config, KVEventsConfig) and self.kv_events_config.enabled

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; use "
                f"{', '.join(QUANTIZATION_METHODS)} or leave it unset"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if isinstance(self.kv_events_config, str):
            self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        if self.publishes_kv_events and not self.enable_prefix_caching:
            raise ValueError("KV cache events describe the prefix cache: enable prefix caching")
        self._validate_lora()

    def _validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, got "
                f"{self.max_lora_rank}"
            )
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
