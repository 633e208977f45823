"""Half-precision dtypes and KV pool sizing from a memory budget."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine.config import EngineConfig
from fleetllm.engine.cpu_linear import PackedLinear, packing_supported
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "To make a cake, first you need",
    "Machine learning is a field of",
    "She opened the door and saw",
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_prefill_is_as_close_to_float32_as_hf(smollm2_dir, dtype: str) -> None:
    """In half precision the first token's distribution is as close to the float32 model's as
    HF's own half-precision forward is. Rounding differs between attention kernels (fleetllm's
    CPU kernels compute in float32 and round once; SDPA's rounds its probabilities to the
    dtype), and over 30 layers either moves a logprob by up to a few tenths in bfloat16, so
    the measure is the mean over several prompts' top tokens, not one token's value."""
    from transformers import LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    reference = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch_dtype).eval()
    llm = LLM(str(smollm2_dir), dtype=dtype, num_kv_blocks=128, max_model_len=1024)
    assert llm.engine.model.model.embed_tokens.weight.dtype == torch_dtype
    # Half precision on the CPU runs its matmuls on prepacked weights.
    assert isinstance(llm.engine.model.lm_head, PackedLinear) == packing_supported(
        torch_dtype, torch.device("cpu")
    )
    assert llm.engine.runner.kv_caches[0][0].dtype == torch_dtype
    ours, theirs = [], []
    for prompt in PROMPTS:
        ids = llm.get_tokenizer().encode(prompt)
        out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=3, logprobs=5))[0]
        with torch.no_grad():
            exact = reference(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            half = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        for token, entry in out.outputs[0].logprobs[0].items():
            ours.append(abs(entry.logprob - exact[token].item()))
            theirs.append(abs(half[token].item() - exact[token].item()))
        if prompt == PROMPTS[0]:
            assert "Paris" in out.outputs[0].text
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert mean_ours <= 1.25 * mean_theirs + 0.01, (mean_ours, mean_theirs)


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
