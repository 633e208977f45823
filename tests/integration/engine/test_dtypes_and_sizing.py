"""Half-precision dtypes and KV pool sizing from a memory budget."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine.config import EngineConfig
from fleetllm.engine.cpu_linear import PackedLinear, packing_supported
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_prefill_matches_hf(smollm2_dir, dtype: str) -> None:
    """In half precision the first token's distribution equals HF's (same dtype, SDPA);
    later tokens may drift apart by rounding, as HF's own attention backends do."""
    from transformers import LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch_dtype).eval()
    llm = LLM(str(smollm2_dir), dtype=dtype, num_kv_blocks=128, max_model_len=1024)
    assert llm.engine.model.model.embed_tokens.weight.dtype == torch_dtype
    # Half precision on the CPU runs its matmuls on prepacked weights.
    assert isinstance(llm.engine.model.lm_head, PackedLinear) == packing_supported(
        torch_dtype, torch.device("cpu")
    )
    assert llm.engine.runner.kv_caches[0][0].dtype == torch_dtype
    ids = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=3, logprobs=5))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    for token, entry in out.outputs[0].logprobs[0].items():
        assert entry.logprob == pytest.approx(ref[token].item(), abs=0.05)
    assert "Paris" in out.outputs[0].text


def test_pool_sized_from_memory_budget(tiny_model) -> None:
    path, _ = tiny_model("llama-mha")
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_fraction=0.5,
    )
    engine = LLMEngine(cfg)
    # Plenty of memory for a tiny model: capped at what 4 full-length sequences can use.
    assert engine.kv.num_blocks == 4 * 256 // 16
    slots = (engine.kv.num_blocks + 1) * 16  # with the null block
    assert engine.runner.kv_caches[0][0].shape == (slots, 4, 16)
