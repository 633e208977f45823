"""The sampler reads the device back once per step, whatever the batch asks for."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fleetllm.engine.sampler import SamplingRow, TokenCounts, sample
from fleetllm.engine.sampling_params import SamplingParams

V = 64
READS = ("tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def batch() -> list[SamplingRow]:
    """Every kind of row: greedy, seeded and unseeded random with each filter, penalties,
    min_tokens, logprobs of different widths."""
    seeded = torch.Generator().manual_seed(5)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.8, seed=5),
        SamplingParams(temperature=1.2, min_p=0.05, logprobs=7),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, presence_penalty=0.5, min_tokens=5, logprobs=1),
    ]
    rows = []
    for params in kinds:
        output = [1, 2, 2, 3]
        counts = TokenCounts(V, [4, 5], output) if params.has_penalties else None
        gen = seeded if params.seed is not None else None
        rows.append(SamplingRow(params, [4, 5], output, frozenset({0, 1}), gen, counts))
    return rows


def test_one_read_back_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: Counter[str] = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original):
            reads[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # The counter sees every kind of read.
    t = torch.ones(1)
    t.tolist(), t.item(), float(t), int(t), bool(t), [0, 1][t.long()], t.numpy(), t.cpu()
    assert sum(reads.values()) == len(READS), reads
    reads.clear()
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(0))
    result = sample(logits, batch(), torch.Generator().manual_seed(1))
    monkeypatch.undo()
    assert not result.errors
    assert sum(reads.values()) == 1, reads
    assert len(result.token_ids) == 7
    assert [lp is not None for lp in result.logprobs] == [
        False,
        True,
        True,
        False,
        True,
        False,
        True,
    ]
    assert len(result.logprobs[4][1]) >= 7  # type: ignore[index]
    # min_tokens masks the stop tokens 0 and 1 for the last row
    assert result.token_ids[6] not in (0, 1)
