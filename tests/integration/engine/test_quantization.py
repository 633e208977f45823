"""int8 weights and an int8 KV cache on SmolLM2-135M: next-token agreement with float32 over
a couple of thousand positions of real text (a license shipped with a dependency), and the
memory they take, measured on the engine's own tensors."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.model_runner import StepInput

POSITIONS = 2048
CHUNK = 256  # later chunks attend over the cached (quantized) K/V of the earlier ones


def real_text_ids(llm: LLM) -> list[int]:
    """The Apache License 2.0, as shipped with safetensors (a dependency): real English text
    that stays the same from run to run."""
    license_file = next(
        f for f in metadata.distribution("safetensors").files or [] if f.name == "LICENSE"
    )
    ids = llm.get_tokenizer().encode(license_file.locate().read_text())
    assert len(ids) >= POSITIONS
    return ids[:POSITIONS]


def next_token_argmax(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The engine's top-1 next token at every position, the text fed as prefill chunks."""
    kv = engine.kv
    assert kv.allocate("probe", len(ids))
    try:
        table = {"probe": (0, list(kv.block_table("probe")))}  # sent with the first chunk
        fresh = kv.take_fresh_blocks()
        tops = []
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            step = StepInput(
                token_ids=chunk,
                positions=list(range(start, start + len(chunk))),
                decodes=[],
                prefills=[("probe", start, len(chunk))],
                table_updates=table,
                logits_indices=list(range(len(chunk))),
                fresh_blocks=(fresh.start, fresh.stop),
            )
            table, fresh = {}, range(0)
            tops.append(engine.executor.execute(step).argmax(-1))
        return torch.cat(tops)
    finally:
        kv.free("probe")


@pytest.fixture(scope="module")
def reference(smollm2_llm: LLM) -> tuple[list[int], torch.Tensor]:
    ids = real_text_ids(smollm2_llm)
    return ids, next_token_argmax(smollm2_llm.engine, ids)


@pytest.mark.slow
def test_int8_weights_agree_with_float32_in_under_a_third_of_the_memory(
    smollm2_dir: Path, smollm2_llm: LLM, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, expected = reference
    with LLM(
        str(smollm2_dir), dtype="float32", quantization="int8", num_kv_blocks=130,
        max_model_len=2048,
    ) as llm:  # fmt: skip
        agreement = (next_token_argmax(llm.engine, ids) == expected).float().mean().item()
        ratio = llm.engine.weight_bytes[0] / smollm2_llm.engine.weight_bytes[0]
    print(f"\nint8 weights: top-1 agreement {agreement:.2%} over {POSITIONS}, memory x{ratio:.3f}")
    # About 3% of this text's positions have a top-1/top-2 logit gap under 0.05, so any
    # rounding flips some: a scale per row (not per group of 32) agreed on 95.3%.
    assert agreement >= 0.98
    # One byte per value, plus a 16-bit scale and offset per 32 values, and the norms.
    assert 0.27 < ratio < 0.29


@pytest.mark.slow
def test_an_int8_kv_cache_agrees_with_float32(
    smollm2_dir: Path, smollm2_llm: LLM, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, expected = reference
    with LLM(
        str(smollm2_dir), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=130,
        max_model_len=2048,
    ) as llm:  # fmt: skip
        agreement = (next_token_argmax(llm.engine, ids) == expected).float().mean().item()
        per_token = llm.engine.kv_cache_bytes[0] / (131 * 16)
    full = smollm2_llm.engine.kv_cache_bytes[0] / ((smollm2_llm.engine.kv.num_blocks + 1) * 16)
    print(
        f"\nint8 KV cache: top-1 agreement {agreement:.2%}, bytes per token x{per_token / full:.3f}"
    )
    assert agreement >= 0.98
    assert per_token / full == (64 + 4) / (64 * 4)  # a float32 scale per token and head
