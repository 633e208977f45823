"""Speculative decoding in the engine: greedy output identical to decoding without it, in
mixed batches (chunked prefills, requests with and without drafts), the KV slots of rejected
drafts released every step, the acceptance rate and step reduction on repetitive text, and
sampling that keeps the model's token distribution (chi-square)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from chisquare import chi_square_p_value
from tinymodels import build_hf_model

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def run_steps(
    llm: LLM, prompts: list, params: list[SamplingParams]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Generate step by step, checking after every step that no request holds blocks beyond
    its tokens (a rejected draft's slots are released at once). The outputs, and each
    request's number of steps (those in which it gained tokens)."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done: dict[str, list[int]] = {}
    steps: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps[out.request_id] = steps.get(out.request_id, 0) + 1
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for req in engine.scheduler.running:
            table = engine.kv.block_table(req.request_id)
            assert len(table) <= engine.kv.blocks_needed(req.num_tokens)
    return done, steps


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen2-bias"])
def test_greedy_output_is_unchanged_in_mixed_batches(variant: str, tiny_model) -> None:
    path, hf = tiny_model(variant)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [
        [5, 6, 7, 8] * 12,  # drafts from the first decode step
        [1, 2, 3] * 20 + [1, 2],
        torch.randint(0, vocab, (70,), generator=g).tolist(),  # few or no drafts
        torch.randint(0, vocab, (3,), generator=g).tolist(),
        [9] * 30,
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 25, 7, 50)
    ]
    results = {}
    for speculative in (None, NGRAM):
        llm = LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            max_num_batched_tokens=24,  # prefill chunks beside the decodes
            speculative_config=speculative,
        )
        results[speculative is None] = run_steps(llm, prompts, params)
        stats = llm.engine.stats()
        if speculative:
            assert stats.spec_decode_num_draft_tokens > 0
            assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    (plain, plain_steps), (spec, spec_steps) = results[True], results[False]
    assert spec == plain
    assert sum(spec_steps.values()) < sum(plain_steps.values())


SMOL_PROMPTS = [
    # Repetitive: the continuation repeats what the context already holds.
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Roses are red, violets are blue. Roses are red, violets are blue. Roses are red,",
    # Not repetitive.
    "The capital of France is",
]


@pytest.mark.slow
def test_smollm2_greedy_is_unchanged_and_repetitive_text_takes_fewer_steps(
    smollm2_dir: Path, smollm2_llm: LLM
) -> None:
    tok = smollm2_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    fixed = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    # A stop string that completes inside a run of accepted drafts.
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["blue. Roses are red, violets"])
    params = [fixed, fixed, stop, fixed]
    plain, plain_steps = run_steps(smollm2_llm, prompts, params)
    spec_llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        num_kv_blocks=128,
        max_model_len=1024,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    )
    spec, spec_steps = run_steps(spec_llm, prompts, params)
    assert spec == plain
    stats = spec_llm.engine.stats()
    acceptance = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    repetitive = ["0", "1", "2"]
    before = sum(plain_steps[r] for r in repetitive)
    after = sum(spec_steps[r] for r in repetitive)
    print(
        f"\nSmolLM2: {stats.spec_decode_num_draft_tokens} draft tokens, "
        f"{stats.spec_decode_num_accepted_tokens} accepted ({acceptance:.0%}); repetitive "
        f"prompts took {before} decode steps without speculation, {after} with "
        f"({before / after:.2f}x fewer); the other prompt {plain_steps['3']} and "
        f"{spec_steps['3']}"
    )
    assert acceptance > 0.5
    assert before / after > 1.3


def test_sampling_keeps_the_models_token_distribution(tmp_path: Path, one_thread: None) -> None:
    """Chi-square over every 3-token continuation of a tiny-vocabulary model: thousands of
    sampled requests, with n-gram drafts accepted and rejected along the way, against the
    probabilities Hugging Face's model gives each continuation."""
    vocab = 6
    hf = build_hf_model("llama", {"vocab_size": vocab, "hidden_size": 32, "num_attention_heads": 2,
                                  "num_key_value_heads": 2, "intermediate_size": 64})  # fmt: skip
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.15)  # a flat enough distribution for every branch to occur
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    # Exact probabilities of each continuation (t1, t2, t3), batched over all prefixes.
    with torch.no_grad():

        def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
            logits = hf(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
            return logits.float().softmax(-1)

        p1 = next_probs([[]])[0]
        p2 = next_probs([[a] for a in range(vocab)])
        pairs = list(itertools.product(range(vocab), repeat=2))
        p3 = next_probs([list(ab) for ab in pairs])
    expected = {
        (a, b, c): float(p1[a] * p2[a, b] * p3[i, c])
        for i, (a, b) in enumerate(pairs)
        for c in range(vocab)
    }
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=2048,
        max_num_seqs=256,
        max_model_len=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                            "prompt_lookup_min": 1},
        seed=7,
    )  # fmt: skip
    trials = 3000
    outputs = llm.generate([prompt] * trials, SamplingParams(temperature=1.0, max_tokens=3))
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 1000
    assert 0.1 < stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens < 0.9
    cells = sorted(expected)
    p_value = chi_square_p_value([counts.get(c, 0) for c in cells], [expected[c] for c in cells])
    assert p_value > 0.001
