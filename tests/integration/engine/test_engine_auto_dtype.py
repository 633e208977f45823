"""The engine resolves dtype="auto" from the CPU probe at start, logs why, and runs in it."""

from __future__ import annotations

import logging

import pytest
import torch

from fleetllm.engine import cpu_features
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("flags", "want"),
    [({"avx2", "fma"}, torch.float32), ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16)],
)
def test_engine_runs_in_the_probed_dtype(
    tiny_model, monkeypatch: pytest.MonkeyPatch, caplog, flags: set[str], want: torch.dtype
) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    path, _ = tiny_model("llama-gqa-tied")
    with caplog.at_level(logging.INFO, logger="fleetllm.engine.engine"):
        llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    engine = llm.engine
    assert engine.dtype == want
    assert engine.model.model.embed_tokens.weight.dtype == want
    assert engine.runner.kv_caches[0][0].dtype == want
    chosen = next(r for r in caplog.records if r.getMessage() == "dtype chosen")
    assert chosen.dtype == str(want).removeprefix("torch.")  # type: ignore[attr-defined]
    assert chosen.requested == "auto"  # type: ignore[attr-defined]
    assert "avx2" in chosen.reason  # type: ignore[attr-defined]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
