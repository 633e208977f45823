"""Greedy decoding equals Hugging Face transformers' greedy `generate`, token for token."""

from __future__ import annotations

import pytest
import torch
from tinymodels import VARIANTS, hf_greedy

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

NEW_TOKENS = 40


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_models_match_hf_greedy(variant: str, tiny_model) -> None:
    path, hf = tiny_model(variant)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128)
    prompts = random_prompts(hf.config.vocab_size, [1, 6, 33, 120])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_sharded_checkpoint_loads_and_matches(tiny_model) -> None:
    path, hf = tiny_model("llama-mha", max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    assert (path / "model.safetensors.index.json").is_file()
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    prompt = random_prompts(hf.config.vocab_size, [17], seed=3)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Les trois couleurs du drapeau français sont",
]


def test_smollm2_matches_hf_greedy(smollm2_llm: LLM, smollm2_hf) -> None:
    tok = smollm2_llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three planets."}])
    prompts = [tok.encode(p) for p in [*SMOL_PROMPTS, chat]]
    # min_tokens = max_tokens keeps EOS out on both sides (HF: min_new_tokens), so every
    # prompt yields the full count.
    params = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48)
    outputs = smollm2_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(smollm2_hf, prompt, 48)
    assert "Paris" in outputs[0].outputs[0].text
