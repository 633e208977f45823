"""Prefix caching: shared prefixes are served from cache, fewer tokens are computed, the
tokens are the same, and eviction under pressure changes nothing but speed."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tinymodels import float32_engine

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.kv_events import BlockRemoved

VARIANT = "llama-mha"
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def tiny_llm(path: Path, **options: Any) -> LLM:
    """The tiny model in float32 on token ids, with the pool and caching options given."""
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, **options)


def computed_tokens(llm: LLM) -> list[int]:
    """Spy: the number of tokens each step computes."""
    counts: list[int] = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        counts.append(out.num_batched_tokens)
        return out

    llm.engine.scheduler.schedule = spy
    return counts


def test_shared_prefix_hits_computes_less_and_matches(tiny_model) -> None:
    path, _ = tiny_model(VARIANT)
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(200)]
    first = [*system, *[rng.randrange(256) for _ in range(10)]]
    second = [*system, *[rng.randrange(256) for _ in range(12)]]

    plain = tiny_llm(path, num_kv_blocks=64, enable_prefix_caching=False)
    expected = plain.generate(second, GREEDY)[0].outputs[0].token_ids

    llm = tiny_llm(path, num_kv_blocks=64)
    llm.generate(first, GREEDY)
    before = llm.engine.stats()
    counts = computed_tokens(llm)
    out = llm.generate(second, GREEDY)[0]
    after = llm.engine.stats()

    assert out.outputs[0].token_ids == expected
    cached = (200 // 16) * 16  # whole blocks of the shared system prompt
    assert out.num_cached_tokens == cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached
    # The prefill computed only the uncached tail; then one token per decode step.
    assert counts[0] == len(second) - cached
    assert sum(counts) == len(second) - cached + GREEDY.max_tokens - 1
    assert after.kv_cache_usage == 0.0


def test_identical_prompt_recomputes_only_its_last_token(tiny_model) -> None:
    path, _ = tiny_model(VARIANT)
    llm = tiny_llm(path, num_kv_blocks=64)
    prompt = list(range(64))  # four full blocks
    a = llm.generate(prompt, GREEDY)[0]
    counts = computed_tokens(llm)
    b = llm.generate(prompt, GREEDY)[0]
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert b.num_cached_tokens == 48  # the block holding the last token is recomputed
    assert counts[0] == 16


def test_eviction_under_pressure_keeps_results_identical(tiny_model) -> None:
    path, _ = tiny_model(VARIANT)
    rng = random.Random(7)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(6)]
    # Pairs share a prefix (the second of a pair can hit); the cycle over six prefixes is far
    # longer than the pool, so older prefixes are evicted before they come round again.
    prompts = [[*prefixes[i // 2 % 6], *[rng.randrange(256) for _ in range(5)]] for i in range(30)]

    plain = tiny_llm(path, num_kv_blocks=256, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]

    # 20 blocks: room for about two requests at a time, far too few to keep every prefix.
    llm = tiny_llm(path, num_kv_blocks=20, max_model_len=160)
    got = []
    for p in prompts:  # one by one, so each finds what the last ones left behind
        got.append(llm.generate(p, GREEDY)[0].outputs[0].token_ids)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert batched == expected
    stats = llm.engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert stats.kv_cache_usage == 0.0


def test_a_steps_evictions_are_known_before_its_forward_pass(tiny_model) -> None:
    """The publisher is told of a step's evictions as soon as it is scheduled: a router then
    stops counting on those blocks a whole forward pass sooner."""
    path, _ = tiny_model(VARIANT)
    events = '{"enable_kv_cache_events": true, "endpoint": "inproc://unused"}'
    engine = float32_engine(path, num_kv_blocks=12, max_model_len=192, kv_events_config=events)
    seen: list[object] = []
    engine.after_schedule = lambda: seen.extend(engine.kv.take_events())
    original = engine._execute

    def execute(*args: Any) -> Any:
        seen.append("forward")
        return original(*args)

    engine._execute = execute  # type: ignore[method-assign]
    rng = random.Random(2)
    # Two prompts of 8 blocks each in a pool of 12: the second evicts the first's blocks.
    for i in range(2):
        prompt = [rng.randrange(256) for _ in range(128)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    removed = [i for i, e in enumerate(seen) if isinstance(e, BlockRemoved)]
    assert removed and seen[removed[-1] + 1 :].count("forward") == 1  # before the step ran
    engine.shutdown()
