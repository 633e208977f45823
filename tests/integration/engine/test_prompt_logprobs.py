"""Prompt logprobs from the prefill: equal to Hugging Face's full forward in float32, across
chunked-prefill boundaries and beside other requests; a request that asks is computed from
scratch while the prefix cache keeps serving the others."""

from __future__ import annotations

import random

import torch

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

VARIANT = "llama-mha"


def hf_prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= 1, and the full rows, from one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def test_prompt_logprobs_match_hf_across_chunks_and_batches(tiny_model) -> None:
    path, model = tiny_model(VARIANT)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (45, 7, 2, 30)]
    # Chunks of 16 tokens: every prompt but the short ones spans several steps.
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        max_num_batched_tokens=16, max_model_len=64,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        expected = hf_prompt_logprobs(model, ids)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            entry = got[i]
            assert entry is not None and ids[i] in entry
            assert abs(entry[ids[i]].logprob - expected[i - 1, ids[i]].item()) < 1e-3
            rank = int((expected[i - 1] > expected[i - 1, ids[i]]).sum()) + 1
            assert entry[ids[i]].rank == rank
            top2 = torch.topk(expected[i - 1], 2).indices.tolist()
            assert set(top2) <= set(entry)
            assert len(entry) <= 3  # the token and the top 2
    # Generation is unchanged by asking.
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3))
    for a, b in zip(outs, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.prompt_logprobs is None


def test_asking_skips_the_cache_but_others_still_hit_it(tiny_model) -> None:
    path, model = tiny_model(VARIANT)
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(48)]
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, greedy)
    asked = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[
        0
    ]
    assert asked.num_cached_tokens == 0
    assert asked.prompt_logprobs is not None and len(asked.prompt_logprobs) == len(prompt)
    expected = hf_prompt_logprobs(model, prompt)
    worst = max(
        abs(asked.prompt_logprobs[i][prompt[i]].logprob - expected[i - 1, prompt[i]].item())
        for i in range(1, len(prompt))
    )
    assert worst < 1e-3
    again = llm.generate(prompt, greedy)[0]
    assert again.num_cached_tokens > 0
