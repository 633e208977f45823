"""logit_bias, allowed_token_ids and bad_words on hand-made logits: each as defined, alone and
together, per row of a batch, with logprobs still those of the raw distribution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.sampler import SamplingRow, sample
from fleetllm.engine.sampling_params import SamplingParams

V = 16


def row(params: SamplingParams, output: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(params, [0], list(output), frozenset(), None)


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_logit_bias_moves_the_greedy_pick_and_only_its_own_row() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    rows = [
        row(SamplingParams(temperature=0, logit_bias={7: 10.0})),
        row(SamplingParams(temperature=0)),
    ]
    assert sample(logits, rows, gen()).token_ids == [7, 3]


def test_a_bias_of_minus_100_bans_a_token_under_sampling() -> None:
    logits = torch.zeros(64, V)
    logits[:, 3] = 4.0
    params = SamplingParams(temperature=1.0, seed=1, logit_bias={3: -100.0})
    picks = sample(logits, [row(params)] * 64, gen()).token_ids
    assert 3 not in picks


@settings(max_examples=50, deadline=None)
@given(
    allowed=st.lists(st.integers(0, V - 1), min_size=1, max_size=V, unique=True),
    seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
)
def test_allowed_token_ids_are_the_only_picks(
    allowed: list[int], seed: int, temperature: float
) -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=allowed)
    picks = sample(logits.clone(), [row(params)] * 8, gen()).token_ids
    assert set(picks) <= set(allowed)
    if temperature == 0.0:
        best = max(allowed, key=lambda t: logits[0, t].item())
        assert picks[0] == best


def test_a_bad_word_is_masked_only_after_its_prefix() -> None:
    logits = torch.zeros(3, V)
    logits[:, 9] = 5.0
    logits[:, 4] = 1.0
    word = SamplingParams(temperature=0, bad_words_token_ids=[[2, 9]])
    single = SamplingParams(temperature=0, bad_words_token_ids=[[9]])
    rows = [row(word, output=(1, 2)), row(word, output=(2, 1)), row(single)]
    # After 2 the word's last token 9 is banned; elsewhere 9 is fine; a one-token word always.
    assert sample(logits, rows, gen()).token_ids == [4, 9, 4]


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    raw = torch.log_softmax(logits, -1)[0]
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={5: 50.0})
    result = sample(logits.clone(), [row(params)], gen())
    assert result.token_ids == [5]
    chosen_lp, _ = result.logprobs[0]
    assert chosen_lp == pytest.approx(raw[5].item(), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
    ],
)
def test_out_of_range_rules_are_refused_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)
