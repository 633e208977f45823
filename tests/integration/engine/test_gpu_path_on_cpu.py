"""The GPU path, run on the CPU: the Triton kernels (in Triton's interpreter without a GPU) and
decode steps through the CUDA-graph runner's padded static buffers (replayed eagerly here),
inside the real engine, give the reference path's tokens."""

from __future__ import annotations

import pytest

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 41))]
MAX_TOKENS = [9, 4, 6]  # the batch shrinks 3 -> 2 -> 1 as requests finish


def generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "mistral-headdim"])
def test_graph_runner_and_kernels_give_the_reference_tokens(
    tiny_model, eager_graphs, variant: str
) -> None:
    path, _ = tiny_model(variant)

    def make() -> LLM:
        return LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=16,
            block_size=4,
            max_model_len=64,
            num_threads=1,
        )

    want = generate(make())

    llm = make()
    runner = llm.engine.runner
    sizes_run = eager_graphs(runner)
    assert generate(llm) == want
    # Every decode step went through the static buffers, padded 3 -> 4 at first.
    assert sizes_run == [3] * 3 + [2] * 2 + [1] * 3
    assert runner.graphs.context_lens[3] == 0  # the padding row
