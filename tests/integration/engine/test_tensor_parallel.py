"""Tensor parallelism on the CPU (gloo), float32: the same greedy tokens as one rank, each rank
holding its share of the weights, refusals of sizes that do not divide, and a dead rank
failing the engine instead of hanging it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from processes import alive
from tinymodels import build_hf_model, hf_greedy

from fleetllm.engine.cpu_linear import packing_supported
from fleetllm.engine.executor import WorkerFailedError
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

NEW_TOKENS = 24


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def wait_gone(pids: list[int], guard_s: float = 30.0) -> None:
    deadline = time.monotonic() + guard_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes still alive: {pids}"
        time.sleep(0.05)


# Heads, KV heads and the MLP split over 2 ranks, or over 3 with a vocabulary that does not
# (250 rows: the last rank's shard is padded). Biases on every projection check that the
# row-parallel ones are added once.
CONFIGS = {
    "gqa-bias-2": (
        2,
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "padded-vocab-3": (
        3,
        {
            "vocab_size": 250,
            "hidden_size": 96,
            "intermediate_size": 132,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "tie_word_embeddings": True,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_models_match_hf_greedy_over_ranks(name: str, tmp_path: Path) -> None:
    size, overrides = CONFIGS[name]
    hf = build_hf_model("llama", overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts(overrides["vocab_size"], [1, 7, 40])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        max_model_len=512,
        tensor_parallel_size=size,
        max_num_batched_tokens=32,  # chunked prefill beside decodes
    ) as llm:
        outputs = llm.generate(prompts, params)
        full = sum(p.numel() * p.element_size() for p in hf.parameters())
        if packing_supported(torch.float32, torch.device("cpu")):
            # The linear layers run on reordered weights, and in float32 keep their plain
            # weight too: every linear's weight twice (a tied head's plain one is the
            # embedding).
            full += sum(m.weight.nbytes for m in hf.modules() if isinstance(m, torch.nn.Linear))
        shares = llm.engine.weight_bytes
        assert llm.engine.stats().kv_cache_usage == 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(shares) == size
    for share in shares:  # a share of everything but the (replicated) norms and biases
        assert full / size <= share <= full / size * 1.1


@pytest.mark.slow
def test_smollm2_tp3_generates_the_tp1_tokens_with_a_third_of_the_weights_each(
    smollm2_dir: Path, smollm2_llm: LLM
) -> None:
    tok = smollm2_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ["The capital of France is", "def fibonacci(n):\n    "]]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    with LLM(
        str(smollm2_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=1024,
        tensor_parallel_size=3,
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        shares = llm.engine.weight_bytes
        kv_shares = llm.engine.kv_cache_bytes
    assert got == expected
    full = smollm2_llm.engine.weight_bytes[0]
    assert len(shares) == 3
    for share in shares:
        assert full / 3 <= share <= full / 3 * 1.01  # the norms are replicated
    # Each rank holds one of the three KV heads of every slot (64 blocks + the null block).
    single = smollm2_llm.engine
    per_slot = single.kv_cache_bytes[0] // ((single.kv.num_blocks + 1) * 16)
    assert kv_shares == [per_slot // 3 * 65 * 16] * 3


def test_sizes_that_do_not_split_the_model_are_refused_before_any_worker_starts(
    smollm2_dir: Path,
) -> None:
    with pytest.raises(ValueError) as caught:
        LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    assert str(caught.value) == (
        "tensor_parallel_size=2 does not divide the model's attention heads (9) and KV heads "
        "(3); sizes that divide them all: 3"
    )


def test_a_dead_rank_fails_the_engine_and_the_other_ranks_stop(tiny_model) -> None:
    path, _ = tiny_model("llama-gqa-tied")
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        max_model_len=512,
        tensor_parallel_size=2,
    )
    engine = llm.engine
    pids = engine.executor.pids
    assert len(pids) == 2 and all(alive(p) for p in pids)
    engine.check_health()
    os.kill(pids[1], signal.SIGKILL)
    # Noticed between steps, without any request: the engine reports the failure...
    deadline = time.monotonic() + 30
    while True:
        try:
            engine.check_health()
        except WorkerFailedError as exc:
            assert f"rank 1 (pid {pids[1]}) exited with code -9" in str(exc)
            break
        assert time.monotonic() < deadline, "the dead rank went unnoticed"
        time.sleep(0.05)
    # ...the surviving rank is stopped, and a step fails at once rather than hanging.
    wait_gone(pids)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(WorkerFailedError):
        engine.step()
    engine.abort_request("r")
    llm.shutdown()
