"""Shared fixtures for the engine tests: the SmolLM2 model files and tiny synthetic GGUF files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch

# transformers is the test oracle; it must never reach for a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"

from transformers import LlamaConfig, LlamaForCausalLM

from fleetllm.engine.model_files import builtin_gguf, resolve_model


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """The engine's CPU kernels (built here if this machine has no build of them yet)."""
    from fleetllm.engine import cpu_kernels

    module = cpu_kernels.load_kernel()
    assert module is not None, "the kernels did not build: see the warning logged above"
    return module


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return builtin_gguf("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2 in Hugging Face layout, converted once into the (shared) model cache."""
    return resolve_model("smollm2-135m")


# A tiny byte-level BPE vocabulary: three control tokens, the 256 byte symbols, three merges.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of each byte value (written out independently here)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, shift = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shift)
            shift += 1
    return [chars[b] for b in range(256)]


TINY_TOKENS = [*_SPECIALS, *byte_alphabet(), "Ġt", "he", "Ġthe"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k (pairs interleaved per head)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_llama(seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    """A random-weight Llama (GQA, untied head) whose weights survive the GGUF types used below
    exactly: the embedding is rounded to float16 and one matrix to its Q8_0 round trip."""
    torch.manual_seed(seed)
    settings: dict[str, object] = {
        "vocab_size": len(TINY_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    settings.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones, so a swapped norm would show
        embed = model.model.embed_tokens.weight
        embed.copy_(embed.half().float())
        down = model.model.layers[0].mlp.down_proj.weight
        q8 = gguf.quants.quantize(down.numpy(), gguf.GGMLQuantizationType.Q8_0)
        down.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    return model


def write_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    *,
    pre: str = "smollm",
    add_bos: bool = False,
    tokenizer_model: str = "gpt2",
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write `model` as llama.cpp does: GGUF names, permuted q/k, mixed tensor types."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(TINY_TOKENS) - len(_SPECIALS)))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TINY_TEMPLATE)
    if extra is not None:
        extra(writer)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    # float16 numpy data is written as an F16 tensor
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].astype(np.float16))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            weight = state[f"model.layers.{layer}.{hf}.weight"]
            if ours == "attn_q":
                weight = llama_cpp_permute(weight, cfg.num_attention_heads)
            elif ours == "attn_k":
                weight = llama_cpp_permute(weight, cfg.num_key_value_heads)
            name = f"blk.{layer}.{ours}.weight"
            if layer == 0 and ours == "ffn_down":
                writer.add_tensor(name, gguf.quants.quantize(weight, q8_0), raw_dtype=q8_0)
            else:
                writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def make_tiny_llama() -> Callable[..., LlamaForCausalLM]:
    return tiny_llama


@pytest.fixture
def make_llama_gguf() -> Callable[..., Path]:
    return write_llama_gguf


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A small llama GGUF (random weights, byte-level BPE vocabulary) in a fresh directory."""
    return write_llama_gguf(tmp_path / "tiny-llama.gguf", tiny_llama())
