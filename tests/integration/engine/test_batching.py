"""Continuous batching gives each request exactly the tokens it gets alone: with chunked
prefill, with a pool small enough to force preemptions, and with aborts. No block leaks."""

from __future__ import annotations

import random

import pytest

from fleetllm.engine import sizing
from fleetllm.engine.attention import TorchPagedAttention
from fleetllm.engine.cpu_attention import CpuPagedAttention
from fleetllm.engine.layer_ops import CpuLayerOps, TorchLayerOps
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

VARIANT = "llama-gqa-tied"


def workload(n: int = 24, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    lengths = [1, 300, *[rng.randint(1, 300) for _ in range(n - 2)]]
    prompts = [[rng.randrange(256) for _ in range(length)] for length in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


def make_llm(path, **kwargs) -> LLM:
    settings = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 400}
    settings.update(kwargs)
    return LLM(str(path), **settings)


@pytest.fixture(scope="module")
def alone(tiny_model) -> list[list[int]]:
    """Reference: each request run by itself on a fresh engine (no prefix cache)."""
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=64, enable_prefix_caching=False)
    prompts, params = workload()
    return [
        llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)
    ]


def check(llm: LLM, alone: list[list[int]]) -> None:
    prompts, params = workload()
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    for out, sp in zip(outputs, params, strict=True):
        assert len(out.outputs[0].token_ids) == sp.max_tokens
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.stats().kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("policy", ["shortest-first", "fcfs"])
def test_submitted_together(tiny_model, alone, policy: str) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=1024, scheduling_policy=policy)
    # On a CPU, with no budget given, a step takes the CPU's (sizing).
    assert llm.engine.scheduler.max_num_batched_tokens == sizing.CPU_MAX_NUM_BATCHED_TOKENS
    assert llm.engine.scheduler.policy == policy
    check(llm, alone)


def test_chunked_prefill_with_tiny_token_budget(tiny_model, alone) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=1024, max_num_batched_tokens=7)
    steps = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        steps.append(out)
        return out

    llm.engine.scheduler.schedule = spy
    check(llm, alone)
    assert max(out.num_batched_tokens for out in steps) <= 7
    # Some step mixed a prefill chunk with decodes.
    assert any(len({s.num_new_tokens > 1 for s in out.scheduled}) == 2 for out in steps)


def test_tiny_pool_forces_preemptions(tiny_model, alone) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=30, max_num_seqs=16)
    check(llm, alone)
    assert llm.engine.stats().num_preemptions > 0


def test_tiny_pool_and_budget_without_prefix_caching(tiny_model, alone) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=26, max_num_batched_tokens=64, enable_prefix_caching=False)
    check(llm, alone)
    assert llm.engine.stats().num_preemptions > 0


def test_abort_mid_flight_frees_everything(tiny_model, alone) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=64)
    engine = llm.engine
    prompts, params = workload()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_cache_usage > 0
    aborted = {str(i) for i in range(0, len(prompts), 2)}
    for rid in aborted:
        out = engine.abort_request(rid)
        assert out is None or out.outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert not aborted & set(finished)
    for rid, tokens in finished.items():
        assert tokens == alone[int(rid)]
    assert engine.stats().kv_cache_usage == 0.0
    # Aborting an unknown or finished request is harmless.
    assert engine.abort_request("0") is None
    assert engine.abort_request("missing") is None


def test_stats_count_tokens_and_requests(tiny_model) -> None:
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.prompt_tokens == 8
    assert stats.generation_tokens == 12
    assert stats.finished == {"length": 2}
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_kv_blocks == 64


def test_the_cpu_kernels_and_the_torch_reference_give_the_same_tokens(tiny_model, alone) -> None:
    """`alone` ran on the CPU kernels (decode attention, the layers' fused elementwise steps),
    the engine's choice on a CPU; the same workload on the torch reference gives the same
    tokens."""
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=1024)
    model = llm.engine.model
    attn = model.attention
    assert isinstance(attn, CpuPagedAttention)
    assert isinstance(model.model.layers[0].mlp.ops, CpuLayerOps)
    model.set_attention(
        TorchPagedAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
    )
    model.set_layer_ops(TorchLayerOps())
    check(llm, alone)


def test_the_cpu_kernels_read_only_what_the_steps_wrote(tiny_model, alone) -> None:
    """On the kernels a block is not zeroed on its first use: every slot of the cache starts
    as NaN here, and the tokens are still those of `alone`."""
    path, _ = tiny_model(VARIANT)
    llm = make_llm(path, num_kv_blocks=256, max_num_seqs=16)
    runner = llm.engine.executor.runner
    assert runner.attention == {"decode": "cpu kernel", "prefill": "cpu kernel"}
    assert not runner.model.attention.reads_whole_blocks
    for k_cache, v_cache in runner.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    check(llm, alone)
