"""The sampler on hand-made logits: penalties as defined, filters, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from fleetllm.engine.sampler import SamplingRow, apply_penalties, filter_logits, sample
from fleetllm.engine.sampling_params import SamplingParams

V = 8


def row(params: SamplingParams, prompt=(0,), output=(), stop=frozenset(), gen=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), stop, gen)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]])
    apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    assert logits[0].tolist() == [1.0, -4.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    logits = torch.zeros(1, V)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [row(params, prompt=[5, 5, 5], output=[1, 1, 1, 2])])
    expected = [0.0] * V
    expected[1] = -(0.5 + 3 * 0.25)
    expected[2] = -(0.5 + 1 * 0.25)
    assert logits[0].tolist() == pytest.approx(expected)


def test_no_penalties_leave_logits_untouched() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    apply_penalties(logits, [row(SamplingParams()), row(SamplingParams(temperature=0))])
    assert torch.equal(logits, before)


def test_greedy_picks_argmax_and_top_k_1_equals_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    greedy = sample(logits.clone(), [row(SamplingParams(temperature=0))] * 16, gen()).token_ids
    assert greedy == logits.argmax(-1).tolist()
    top1 = sample(
        logits.clone(), [row(SamplingParams(temperature=1.3, top_k=1))] * 16, gen()
    ).token_ids
    assert top1 == greedy


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(top_p=0.8)).isfinite().tolist()
    assert kept == [True, True, False, False]
    kept = filter_logits(probs.log(), SamplingParams(top_p=0.81)).isfinite().tolist()
    assert kept == [True, True, True, False]
    # The top token always survives.
    kept = filter_logits(probs.log(), SamplingParams(top_p=0.1)).isfinite().tolist()
    assert kept == [True, False, False, False]


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(min_p=0.25)).isfinite().tolist()
    assert kept == [True, True, True, False]


def test_top_k_keeps_k_best() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = filter_logits(logits, SamplingParams(top_k=2)).isfinite().tolist()
    assert kept == [False, True, False, True, False]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    logits = probs.log().repeat(4000, 1)
    ids = sample(logits, [row(SamplingParams(temperature=1.0))] * 4000, gen(3)).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=4).float() / 4000
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1, 0.0], abs=0.03)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [
        sample(logits[i : i + 1].clone(), [row(params, gen=gen(42))], gen(0)).token_ids[0]
        for i in range(6)
    ]
    # Now in a batch with unseeded rows drawn from another generator.
    seeded_gens = [gen(42) for _ in range(6)]
    mixed_rows = []
    mixed_logits = []
    for i in range(6):
        mixed_rows += [row(params, gen=seeded_gens[i]), row(SamplingParams(temperature=1.0))]
        mixed_logits += [logits[i], torch.randn(50)]
    batched = sample(torch.stack(mixed_logits), mixed_rows, gen(99)).token_ids[::2]
    assert batched == alone


def test_min_tokens_masks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 10.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    stop = frozenset({1})
    assert sample(logits.clone(), [row(params, output=[3], stop=stop)], gen()).token_ids == [2]
    assert sample(logits.clone(), [row(params, output=[3, 3], stop=stop)], gen()).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0)
    result = sample(logits.clone(), [row(params, prompt=[1])], gen())
    token = result.token_ids[0]
    assert token == 2  # the penalty moved the choice; logprobs still describe raw logits
    token_lp, entries = result.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert token_lp == pytest.approx(float(raw[2]))
    assert entries[2].rank == 2
    assert entries[1].rank == 1 and entries[1].logprob == pytest.approx(float(raw[1]))
    assert set(entries) == {1, 2}
    assert math.exp(token_lp) < 1.0


def test_logprobs_absent_unless_asked() -> None:
    result = sample(torch.randn(2, V), [row(SamplingParams())] * 2, gen())
    assert result.logprobs == [None, None]
