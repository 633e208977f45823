"""LoRA adapters in PEFT's format: read one from its folder and check it against the model.

A PEFT adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
rsLoRA, per-module rank and alpha patterns) and `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (A: [r, in]) and
`...lora_B.weight` (B: [out, r]) for each adapted projection of a Llama layer. The delta a
projection adds is `scaling * B @ A @ x`, `scaling` being `lora_alpha / r` (rsLoRA:
`lora_alpha / sqrt(r)`); it is folded into B here, once.

Everything in the folder comes from outside: every check that can fail does so here with a
`LoRAAdapterError` (a ValueError: the caller's fault, answered 400) naming what is wrong, before
any tensor reaches the engine. Sizes are bounded before reading: the config by
`MAX_CONFIG_BYTES`, the weights by what an adapter of the largest allowed rank can hold.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from fleetllm.engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20

# The projections an adapter may adapt, by the names PEFT writes for Llama, and the block
# of the layer that holds each.
MODULE_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
SUPPORTED_MODULES = tuple(MODULE_PARENTS)

# Initialisations that only set the adapter's starting weights (a saved adapter is a plain
# LoRA); the others (PiSSA, OLoRA, LoftQ, CorDA) also changed the base weights in training.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# PEFT features that change what the adapter computes, and that the engine does not run.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights)",
    "use_qalora": "QALoRA (use_qalora)",
}
_UNSUPPORTED_LISTS = {
    "modules_to_save": "modules_to_save (fully trained modules beside the LoRA)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class LoRAAdapterError(ValueError):
    """The adapter cannot be served as it is; the message says why."""


class LoRAAdapterNotFoundError(LookupError):
    """No adapter at that path (vLLM's wording and 404)."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(f"Loading lora {name} failed: No adapter found for {path}")


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A checked adapter, held on the CPU in float32: for each (layer, PEFT module name) its
    A [rank, in] and B [out, rank] with the scaling folded into B."""

    name: str
    path: str
    key: bytes
    """SHA-256 of its config and weights: equal keys mean the same adapter whatever its name
    (prefix-cache blocks and device slots are shared by key)."""
    rank: int
    """The largest rank of its modules."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    model: ModelConfig = field(repr=False)
    """The model it was checked against: an engine runs only adapters of its own model."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of one projection of the whole (unsharded) model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[module]


def check_path(path: str, allowed_roots: list[Path] | None) -> Path:
    """The adapter folder's real path, refused when it lies outside every allowed root
    (symbolic links are followed first, so a link cannot lead outside)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise LoRAAdapterError("lora_path must be a non-empty path")
    real = Path(path).expanduser().resolve()
    if allowed_roots is not None and not any(real.is_relative_to(r) for r in allowed_roots):
        roots = ", ".join(str(r) for r in allowed_roots)
        raise LoRAAdapterError(f"lora_path {path!r} is outside the allowed folders ({roots})")
    return real


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder `path` for a model of config `cfg`."""
    folder = check_path(path, None)
    if not folder.exists():
        raise LoRAAdapterNotFoundError(name, path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"lora_path {path!r} is not a folder")
    config_bytes = _read_file(folder / CONFIG_FILE, MAX_CONFIG_BYTES)
    config = _parse_config(config_bytes)
    ranks = _Ranks(config)
    if ranks.largest > max_rank:
        raise LoRAAdapterError(
            f"LoRA rank {ranks.largest} is greater than max_lora_rank {max_rank}"
        )
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file() and (folder / "adapter_model.bin").is_file():
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE} is missing; adapter_model.bin (a pickle) is not loaded: save the "
            "adapter with safe_serialization=True"
        )
    # float64 values of every supported module at the largest rank, and room for the header.
    bound = 8 * max_rank * cfg.num_layers * sum(sum(module_shape(cfg, m)) for m in MODULE_PARENTS)
    raw = _read_file(weights_path, bound + MAX_CONFIG_BYTES)
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    weights = _check_tensors(tensors, cfg, ranks)
    key = hashlib.sha256(b"fleetllm-lora\0" + hashlib.sha256(config_bytes).digest() + raw)
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, str(folder), key.digest(), rank, weights, cfg)


def _read_file(path: Path, limit: int) -> bytes:
    if not path.is_file():
        raise LoRAAdapterError(f"the adapter folder has no {path.name}")
    size = path.stat().st_size
    if size > limit:
        raise LoRAAdapterError(
            f"{path.name} is {size} bytes, more than an adapter of this model can hold ({limit})"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise LoRAAdapterError(f"{path.name} cannot be read: {exc.strerror}") from None


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAAdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"peft_type {peft_type!r} is not supported; only LORA is")
    refused = [what for key, what in _UNSUPPORTED_FLAGS.items() if config.get(key)]
    refused += [what for key, what in _UNSUPPORTED_LISTS.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r} (trained biases)")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, bool) and str(init).lower() not in _PLAIN_INITS:
        refused.append(f"init_lora_weights={init!r} (it changed the base weights in training)")
    if refused:
        raise LoRAAdapterError(f"the adapter uses what the engine does not run: {refused}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        if not targets or not all(isinstance(t, str) for t in targets):
            raise LoRAAdapterError("target_modules must be a non-empty list of module names")
        unsupported = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unsupported:
            raise LoRAAdapterError(
                f"target_modules {unsupported} are not supported; supported: "
                f"{', '.join(SUPPORTED_MODULES)}"
            )
    elif not isinstance(targets, str):  # a regular expression over module names
        raise LoRAAdapterError("target_modules must be a list of module names or a pattern")
    return config


class _Ranks:
    """Each module's rank and scaling: `r` and `lora_alpha`, or their per-module overrides
    (`rank_pattern`, `alpha_pattern`: the first key that is the end of the module's name at a
    dot). PEFT reads the keys as regular expressions; here they are plain names, as PEFT
    writes them, so that an adapter's config cannot make the match take exponential time."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.r = _positive_int(config.get("r"), "r")
        self.alpha = _finite(config.get("lora_alpha", self.r), "lora_alpha")
        self.rslora = config.get("use_rslora", False)
        if not isinstance(self.rslora, bool):
            raise LoRAAdapterError("use_rslora must be true or false")
        self.rank_pattern = _mapping(config.get("rank_pattern"), "rank_pattern")
        self.alpha_pattern = _mapping(config.get("alpha_pattern"), "alpha_pattern")
        for key, value in self.rank_pattern.items():
            _positive_int(value, f"rank_pattern[{key!r}]")
        for key, value in self.alpha_pattern.items():
            _finite(value, f"alpha_pattern[{key!r}]")
        self.largest = max([self.r, *self.rank_pattern.values()])

    def of(self, module_name: str) -> tuple[int, float]:
        rank = _match(self.rank_pattern, module_name, self.r)
        alpha = _match(self.alpha_pattern, module_name, self.alpha)
        return rank, alpha / (math.sqrt(rank) if self.rslora else rank)


def _match(pattern: dict[str, Any], name: str, default: Any) -> Any:
    for key, value in pattern.items():
        if name == key or name.endswith(f".{key}"):
            return value
    return default


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAAdapterError(f"{what} must be a positive integer, got {value!r}")
    return value


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LoRAAdapterError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LoRAAdapterError(f"{what} must be a JSON object")
    return value


def _check_tensors(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, ranks: _Ranks
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or MODULE_PARENTS.get(match[3]) != match[2]:
            unexpected.append(key)
            continue
        layer = int(match[1])
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{key}: the model has {cfg.num_layers} layers")
        parts.setdefault((layer, match[3]), {})[match[4]] = tensor
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (" ..." if len(unexpected) > 3 else "")
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE} holds tensors of modules the engine does not adapt: {shown} "
            f"(supported: {', '.join(SUPPORTED_MODULES)} of each layer)"
        )
    if not parts:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(parts.items()):
        prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENTS[module]}.{module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"{prefix} has no {missing}.weight")
        rank, scaling = ranks.of(f"model.layers.{layer}.{MODULE_PARENTS[module]}.{module}")
        inputs, outputs = module_shape(cfg, module)
        a, b = pair["A"], pair["B"]
        for tensor, name, want in ((a, "lora_A", (rank, inputs)), (b, "lora_B", (outputs, rank))):
            if tensor.dtype not in _FLOAT_DTYPES:
                raise LoRAAdapterError(f"{prefix}.{name}.weight is {tensor.dtype}, not floating")
            if tuple(tensor.shape) != want:
                raise LoRAAdapterError(
                    f"{prefix}.{name}.weight has shape {tuple(tensor.shape)}, expected {want}"
                )
            if not torch.isfinite(tensor).all():
                raise LoRAAdapterError(f"{prefix}.{name}.weight holds non-finite values")
        weights[(layer, module)] = (
            a.to(torch.float32).contiguous(),
            (b.to(torch.float32) * scaling).contiguous(),
        )
    return weights
