"""Conversion of a llama.cpp GGUF file into a Hugging Face model directory.

The output is what the engine (and transformers) load from any Hugging Face checkpoint:
`config.json`, `generation_config.json`, `model.safetensors` (float32, Hugging Face tensor
names and row order), `tokenizer.json` and `tokenizer_config.json`. Only what the directory
format can express faithfully is converted; anything else is refused with a clear error rather
than converted into a model that silently computes something different.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

# Part of every cache key: bump it whenever the files written here change, so directories
# converted by an older build are not reused.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)


class GGUFConversionError(ValueError):
    """The GGUF file is unreadable or describes a model this converter cannot express."""


_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# Precomputed RoPE frequency divisors (llama3-style scaling); folded into config.json instead.
_ROPE_FREQS = "rope_freqs.weight"


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFConversionError(f"GGUF metadata lacks required key {key!r}")
        return value


@dataclass(frozen=True)
class _PlannedTensor:
    hf_name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


def read_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, struct.error) as exc:
        raise GGUFConversionError(f"{path} is not a readable GGUF file: {exc}") from exc


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write the Hugging Face form of `gguf_path` into the existing, empty `out_dir`.

    `progress` draws a bar on stderr; `on_progress(done, total)` is called after each tensor
    (for callers that show progress their own way)."""
    reader = read_gguf(gguf_path)
    meta = GGUFMetadata(reader)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _llama_config(meta, tensors)
    plan = _plan_tensors(tensors, config)

    tokenizer_json, tokenizer_config = build_tokenizer_files(meta)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]

    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    bar = tqdm(
        plan,
        desc=f"Converting {gguf_path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )

    def arrays() -> Iterator[np.ndarray]:
        for done, item in enumerate(bar):
            yield item.load()
            if on_progress is not None:
                on_progress(done + 1, len(plan))

    _write_safetensors(out_dir / "model.safetensors", plan, arrays())


def _llama_config(meta: GGUFMetadata, tensors: dict[str, Any]) -> dict[str, Any]:
    def key(name: str) -> Any:
        return meta.require(f"llama.{name}")

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    value_dim = int(meta.get("llama.attention.value_length", head_dim))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise GGUFConversionError(
            f"key length {head_dim} differs from value length {value_dim}; not a Llama layout"
        )
    if rope_dim != head_dim:
        raise GGUFConversionError(
            f"RoPE covers {rope_dim} of {head_dim} head dimensions; partial rotary embeddings "
            "are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise GGUFConversionError("GGUF file has no token_embd.weight tensor")
    # The embedding's rows are the model's vocabulary, whatever the metadata says.
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(meta, tensors, rope_theta, head_dim),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": vocab_size,
        # llama.cpp omits output.weight exactly when the model reuses its embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        # Dequantized values are exact in float32; the engine picks its compute dtype at load.
        "torch_dtype": "float32",
    }
    return config


def _rope_scaling(
    meta: GGUFMetadata, tensors: dict[str, Any], theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type")
    if _ROPE_FREQS in tensors:
        if kind not in (None, "none"):
            raise GGUFConversionError(
                f"GGUF has both rope_freqs and rope scaling type {kind!r}; cannot express both"
            )
        divisors = dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        return llama3_rope_scaling(np.asarray(divisors, dtype=np.float64), theta, head_dim)
    # Older files state a linear factor without a type.
    factor = meta.get("llama.rope.scaling.factor")
    if kind is None and factor is not None:
        kind = "linear"
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        original = meta.get("llama.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = meta.get(f"llama.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = _f32(value)
        return scaling
    raise GGUFConversionError(f"RoPE scaling type {kind!r} is not supported")


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover Hugging Face's llama3 `rope_scaling` from llama.cpp's per-frequency divisors.

    llama.cpp stores the divisors Llama 3.1's scheme produces (1 for high frequencies, `factor`
    for low ones, a smooth blend between). The Hugging Face parameters producing them are unique
    only up to a common scale of (low_freq_factor, high_freq_factor, original context length),
    so low_freq_factor is pinned to 1 and the other two are fitted on the blended band. The fit
    is accepted only if it reproduces every divisor.
    """
    if divisors.shape != (head_dim // 2,):
        raise GGUFConversionError(
            f"rope_freqs has {divisors.size} entries; expected {head_dim // 2} (head_dim / 2)"
        )
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    blended = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if blended.sum() < 2:
        raise GGUFConversionError(
            "rope_freqs does not follow the llama3 scaling scheme (too few blended frequencies)"
        )
    # blend s = 1 at high frequencies, 0 at low: 1/divisor = (1 - s) / factor + s
    s = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[blended], s, 1)
    high_freq_factor = 1 - 1 / intercept
    original = slope * (high_freq_factor - 1)
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": 1.0,
        # a least-squares fit: 6 digits keep 4.0 from reading 4.0000000000021
        "high_freq_factor": float(f"{high_freq_factor:.6g}"),
        "original_max_position_embeddings": round(original),
    }
    if not np.allclose(_llama3_divisors(scaling, wavelen), divisors, rtol=1e-4, atol=0):
        raise GGUFConversionError("rope_freqs does not follow the llama3 scaling scheme")
    return scaling


def _llama3_divisors(scaling: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The frequency divisors Llama 3.1's RoPE scaling applies at each wavelength."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    # End-of-turn / end-of-message ids end generation too (llama.cpp treats them all as
    # end-of-generation), as Llama 3's own generation_config lists them.
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{name}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    generation: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        generation["pad_token_id"] = int(pad)
    return generation


def _plan_tensors(tensors: dict[str, Any], config: dict[str, Any]) -> list[_PlannedTensor]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_layers = config["num_hidden_layers"]
    plan = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        rotary_heads = None
        if name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[name]
        else:
            match = _LAYER_NAME.match(name)
            suffix = match.group(2) if match else None
            if match is None or suffix not in _LAYER_TENSORS or int(match.group(1)) >= num_layers:
                raise GGUFConversionError(f"unexpected tensor {name!r} in a llama GGUF file")
            hf_name = f"model.layers.{match.group(1)}.{_LAYER_TENSORS[suffix]}"
            rotary_heads = {"attn_q.weight": heads, "attn_k.weight": kv_heads}.get(suffix)
        # GGUF lists dimensions fastest-first; numpy (and safetensors) slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        plan.append(_PlannedTensor(hf_name, shape, _loader(tensor, rotary_heads)))
    return plan


def _loader(tensor: Any, rotary_heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFConversionError(
                f"{tensor.name}: tensor type {tensor.tensor_type.name} cannot be dequantized"
            ) from exc
        if rotary_heads is not None:
            array = unpermute_rotary_rows(array, rotary_heads)
        return array

    return load


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Hugging Face's RoPE rotates dimension i of a head with dimension i + head_dim/2; llama.cpp's
    rotates adjacent pairs (2i, 2i+1), so its converter interleaves each head's two halves. This
    puts row 2i back at i and row 2i+1 at head_dim/2 + i.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFConversionError(f"{rows} rows cannot be split into {num_heads} rotary heads")
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _write_safetensors(
    path: Path, plan: list[_PlannedTensor], arrays: Iterator[np.ndarray]
) -> None:
    """Stream float32 tensors into a safetensors file, holding one tensor in memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        size = 4 * math.prod(item.shape)
        header[item.hf_name] = {
            "dtype": "F32",
            "shape": list(item.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for item, array in zip(plan, arrays, strict=True):
            if array.shape != item.shape:
                raise GGUFConversionError(
                    f"{item.hf_name}: dequantized shape {array.shape} != declared {item.shape}"
                )
            f.write(np.ascontiguousarray(array, dtype="<f4").data)


def _f32(value: float) -> float:
    """GGUF stores float32; its shortest decimal (1e-05, not 9.999999747378752e-06) is the
    value the model was configured with."""
    return float(str(np.float32(value)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# llama.cpp's `tokenizer.ggml.pre` names, grouped by the splitting regex their tokenizers use
# (llama.cpp's llama-vocab.cpp); each group maps onto Hugging Face's pre-tokenizer for it.
_PRE_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
)
_PRE_GPT2 = frozenset({"default", "gpt-2", "mpt", "olmo", "jais"})
_PRE_LLAMA3 = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4


def build_tokenizer_files(meta: GGUFMetadata) -> tuple[str, dict[str, Any]]:
    """`tokenizer.json` (as a string) and `tokenizer_config.json` for a GGUF vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"unsupported tokenizer: GGUF tokenizer model {kind!r}; only byte-level BPE "
            "('gpt2') vocabularies can be converted. Use a Hugging Face directory with a "
            "tokenizer.json for this model instead."
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFConversionError(f"malformed BPE merge {merge!r}")
        merges.append((left, right))

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    # Special tokens are matched whole before BPE, so `<|im_start|>` never splits into pieces.
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, token_type in zip(tokens, types, strict=True)
            if token_type == _CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, token_type in zip(tokens, types, strict=True)
            if token_type == _USER_DEFINED
        ]
    )

    def token_at(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _post_processor(
        vocab, bos if add_bos else None, eos if add_eos else None
    )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer.to_str(), config


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_PRE_DIGITS_THEN_GPT2 | _PRE_GPT2 | _PRE_LLAMA3)
    raise GGUFConversionError(
        f"unsupported tokenizer: pre-tokenizer {pre!r} (supported: {', '.join(known)})"
    )


def _post_processor(
    vocab: dict[str, int], bos: str | None, eos: str | None
) -> processors.PostProcessor:
    offsets = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return offsets

    def wrap(sequence: str, type_id: int) -> list[str]:
        head = [f"{bos}:{type_id}"] if bos is not None else []
        tail = [f"{eos}:{type_id}"] if eos is not None else []
        return [*head, sequence, *tail]

    specials = dict.fromkeys(tok for tok in (bos, eos) if tok is not None)
    template = processors.TemplateProcessing(
        single=wrap("$A:0", 0),
        pair=wrap("$A:0", 0) + wrap("$B:1", 1),
        special_tokens=[(tok, vocab[tok]) for tok in specials],
    )
    return processors.Sequence([offsets, template])
