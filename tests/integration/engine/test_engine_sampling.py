"""Sampling and stopping on SmolLM2: seeds, top-k=1, stop strings and tokens, logprobs, n,
chat, streaming text that is never taken back and never splits a character."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

PROMPT = "Write a short poem about the sea:"


def text_of(llm: LLM, prompt, params: SamplingParams) -> str:
    return llm.generate(prompt, params)[0].outputs[0].text


def test_same_seed_same_text_whatever_the_batch(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = text_of(smollm2_llm, PROMPT, params)
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = smollm2_llm.generate(
        ["Tell me a joke.", PROMPT, "List three colors:"], [others, params, others]
    )
    assert batch[1].outputs[0].text == alone
    other_seed = text_of(smollm2_llm, PROMPT, dataclasses.replace(params, seed=4321))
    assert other_seed != alone


def test_top_k_1_equals_greedy(smollm2_llm: LLM) -> None:
    greedy = text_of(smollm2_llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=24))
    top1 = text_of(
        smollm2_llm, PROMPT, SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=24)
    )
    assert top1 == greedy


def test_stop_strings_trim_the_text(smollm2_llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = smollm2_llm.generate(PROMPT, base)[0].outputs[0]
    # A stop string that starts inside one token and ends inside a later one.
    start = len(full.text) // 2
    stop = full.text[start : start + 7]
    assert stop.strip(), full.text
    idx = full.text.index(stop)

    out = smollm2_llm.generate(PROMPT, dataclasses.replace(base, stop=[stop, "\x00never"]))[0]
    assert out.outputs[0].text == full.text[:idx]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < len(full.token_ids)

    kept = smollm2_llm.generate(
        PROMPT, dataclasses.replace(base, stop=stop, include_stop_str_in_output=True)
    )[0]
    assert kept.outputs[0].text == full.text[: idx + len(stop)]


def test_stop_token_ids_and_length(smollm2_llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = smollm2_llm.generate(PROMPT, base)[0].outputs[0]
    assert full.finish_reason == "length"
    assert len(full.token_ids) == 30
    target = full.token_ids[9]
    first = full.token_ids.index(target)
    out = smollm2_llm.generate(PROMPT, dataclasses.replace(base, stop_token_ids=[target]))[0]
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == target


def test_min_tokens_defers_stopping(smollm2_llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = smollm2_llm.generate(PROMPT, base)[0].outputs[0]
    target = full.token_ids[2]
    params = dataclasses.replace(base, stop_token_ids=[target], min_tokens=12)
    out = smollm2_llm.generate(PROMPT, params)[0].outputs[0]
    assert len(out.token_ids) >= 12


def test_chat_ends_at_eos(smollm2_llm: LLM) -> None:
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is 2 + 2? Answer with one number."}],
        SamplingParams(temperature=0.0, max_tokens=64),
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS, not a user stop
    assert "4" in out.text
    assert "<|im_end|>" not in out.text


def test_logprobs_for_each_sampled_token(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    out = smollm2_llm.generate(PROMPT, params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, entries in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entries
        assert entries[token].rank == 1  # greedy picks the top token
        assert 3 <= len(entries) <= 4
        assert all(e.logprob <= 0 for e in entries.values())
        total += entries[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_n_samples_with_seed(smollm2_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    first = smollm2_llm.generate(PROMPT, params)[0]
    again = smollm2_llm.generate(PROMPT, params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert len({c.text for c in first.outputs}) > 1


def test_streamed_text_is_never_taken_back(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.engine
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = smollm2_llm.generate(PROMPT, base)[0].outputs[0].text
    stop = full[20:26]
    engine.add_request("stream", PROMPT, dataclasses.replace(base, stop=stop))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.outputs[0].text for o in engine.step()]
    final = seen[-1]
    assert final == full[: full.index(stop)]
    for earlier, later in itertools.pairwise(seen):
        assert later.startswith(earlier)


def test_multibyte_text_is_never_split(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.engine
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=40)
    engine.add_request("mb", "Translate to Chinese and add emoji: I love the sea 🌊", params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts
    final = texts[-1]
    for text in texts[:-1]:
        assert "\ufffd" not in text or "\ufffd" in final
        assert final.startswith(text)
