"""Speculative decoding without a model: n-gram proposals, the verification rules (greedy and
rejection sampling, checked against the target distribution), the config, and scheduling."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from chisquare import chi_square_p_value
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.config import SpeculativeConfig
from fleetllm.engine.request import Request
from fleetllm.engine.sampler import SamplingRow, filter_logits, sample
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.scheduler import Scheduler
from fleetllm.engine.spec_decode import NgramProposer, ngram_lookup, verify


def row(params: SamplingParams, output=(), stop=frozenset(), gen=None) -> SamplingRow:
    return SamplingRow(params, [0], list(output), stop, gen)


# -- proposals ------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_suffix_and_its_earliest_occurrence() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 2, 3]
    # The 2-gram [2, 3] first occurred at 1, followed by 9, 2, 3.
    assert ngram_lookup(tokens, 1, 2, 3) == [9, 2, 3]
    # A 3-gram [5, 2, 3] occurred nowhere before; [2, 3] did.
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 2]
    # Only 3-grams allowed: no match.
    assert ngram_lookup(tokens, 3, 3, 2) == []
    # The suffix itself is never its own match.
    assert ngram_lookup([7, 8], 1, 2, 4) == []
    assert ngram_lookup([7], 1, 2, 4) == []
    # A run continues with itself.
    assert ngram_lookup([4, 4, 4, 4], 1, 2, 3) == [4, 4]


def lookup_by_definition(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 6),
    st.integers(0, 6),
    st.integers(1, 5),
)
def test_ngram_lookup_follows_its_definition(
    tokens: list[int], min_n: int, extra: int, k: int
) -> None:
    assert ngram_lookup(tokens, min_n, min_n + extra, k) == lookup_by_definition(
        tokens, min_n, min_n + extra, k
    )


def test_proposals_stay_within_max_tokens_max_model_len_and_the_budget() -> None:
    cfg = SpeculativeConfig("ngram", 5, 2, 1)
    proposer = NgramProposer(cfg, max_model_len=100)
    prompt = [1, 2, 3] * 10

    def req(max_tokens: int | None, outputs: int = 0, prompt=prompt) -> Request:
        r = Request("r", None, list(prompt), SamplingParams(max_tokens=max_tokens), frozenset())
        for i in range(outputs):
            r.append_token([1, 2, 3][i % 3])  # the pattern goes on
        return r

    assert proposer.propose(req(None), 16) == [1, 2, 3, 1, 2]  # k drafts
    assert proposer.propose(req(None), 2) == [1, 2]  # the step's token budget
    # With 3 more tokens allowed, a step emits at most drafts + 1 = 3.
    assert proposer.propose(req(10, outputs=7), 16) == [2, 3]
    assert proposer.propose(req(10, outputs=9), 16) == []
    # 98 tokens in a 100-token context: one draft, then the step's own token.
    long_prompt = [1, 2, 3] * 32 + [1, 2]
    assert proposer.propose(req(None, prompt=long_prompt), 16) == [3]


def test_speculative_config_follows_vllm_names_and_defaults() -> None:
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({}) is None
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_max, both.prompt_lookup_min) == (5, 5)
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    parsed = SpeculativeConfig.parse(text)
    assert parsed == SpeculativeConfig("ngram", 4, 3, 3)
    assert SpeculativeConfig.parse(parsed.to_dict()) == parsed
    for bad, words in [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 65},
            "prompt_lookup_max must be at most 64, got 65",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min (4) exceeds prompt_lookup_max (2)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, "unknown keys"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as caught:
            SpeculativeConfig.parse(bad)
        assert words in str(caught.value)


_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_KEYS = st.sampled_from(
    ["method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"]
)
_VALUES = _JSON_SCALARS | st.sampled_from(["ngram", 1, 2, 5, 16, 17, 64, 65])


@given(
    st.dictionaries(_KEYS, _VALUES, max_size=5)
    | st.text(max_size=40)
    | st.lists(_JSON_SCALARS, max_size=3)
)
def test_any_speculative_config_is_parsed_in_bounds_or_refused_clearly(value: object) -> None:
    try:
        parsed = SpeculativeConfig.parse(value)  # type: ignore[arg-type]
    except ValueError as exc:
        assert str(exc).startswith("speculative_config")
        return
    if parsed is not None:
        assert parsed.method == "ngram"
        assert 1 <= parsed.num_speculative_tokens <= 16
        assert 1 <= parsed.prompt_lookup_min <= parsed.prompt_lookup_max <= 64
        assert SpeculativeConfig.parse(json.dumps(parsed.to_dict())) == parsed


# -- verification ---------------------------------------------------------------------------


def test_greedy_accepts_the_agreeing_prefix_then_corrects() -> None:
    logits = torch.full((4, 8), -5.0)
    for j, best in enumerate([3, 5, 6, 1]):
        logits[j, best] = 5.0
    greedy = SamplingParams(temperature=0)
    gen = torch.Generator().manual_seed(0)
    out = verify(logits.clone(), row(greedy), [3, 5, 7], gen)
    assert (out.token_ids, out.num_accepted) == ([3, 5, 6], 2)
    out = verify(logits.clone(), row(greedy), [3, 5, 6], gen)
    assert (out.token_ids, out.num_accepted) == ([3, 5, 6, 1], 3)  # all accepted + bonus
    out = verify(logits.clone(), row(greedy), [0, 5, 6], gen)
    assert (out.token_ids, out.num_accepted) == ([3], 0)


def test_each_row_is_processed_as_if_the_drafts_before_it_were_emitted() -> None:
    """Penalties and min_tokens see the drafts: the same tokens as decoding one at a time."""
    logits = torch.zeros(3, 8)
    logits[0, [2, 4]] = torch.tensor([4.0, 3.0])  # stop token 2 wins, but min_tokens masks it
    logits[1, [2, 4, 5]] = torch.tensor([1.0, 3.0, 2.0])  # 4 wins, but it was just emitted
    logits[2, [2, 4, 5]] = torch.tensor([1.5, 3.0, 2.5])
    params = SamplingParams(temperature=0, presence_penalty=2.0, min_tokens=2)
    stop = frozenset({2})
    drafts = [4, 5]
    out = verify(logits.clone(), row(params, output=[7], stop=stop), drafts, torch.Generator())
    expected: list[int] = []
    outputs = [7]
    for j in range(len(drafts) + 1):
        token = sample(logits[j : j + 1].clone(), [row(params, outputs, stop)], None).token_ids[0]
        expected.append(token)
        outputs.append(token)
    assert expected == [4, 5, 2]
    assert (out.token_ids, out.num_accepted) == (expected, 2)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
)
def test_rejection_sampling_keeps_the_target_distribution(
    params: SamplingParams, one_thread: None
) -> None:
    """Chi-square: the first emitted token follows row 0's distribution, and after an
    accepted first draft the second follows row 1's, whatever the drafts were."""
    torch.manual_seed(3)
    logits = torch.randn(3, 6) * 1.5
    target = [
        filter_logits(logits[j] / params.temperature, params).softmax(-1).tolist() for j in range(3)
    ]
    # Drafts the filters keep, neither certain: the runner-up of row 0, the best of row 1.
    drafts = [
        sorted(range(6), key=lambda t: -target[0][t])[1],
        max(range(6), key=target[1].__getitem__),
    ]
    gen = torch.Generator().manual_seed(11)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    accepted = 0
    trials = 6000
    for _ in range(trials):
        out = verify(logits.clone(), row(params), drafts, gen)
        first[out.token_ids[0]] += 1
        if out.num_accepted >= 1:
            accepted += 1
            second[out.token_ids[1]] += 1
        assert out.num_accepted == len(out.token_ids) - 1
    # Both outcomes occur: the test exercises acceptance and rejection.
    assert 0 < accepted < trials
    assert accepted / trials == pytest.approx(target[0][drafts[0]], abs=0.03)
    assert chi_square_p_value([first[t] for t in range(6)], target[0]) > 0.001
    assert chi_square_p_value([second[t] for t in range(6)], target[1]) > 0.001


def test_logprobs_are_those_of_the_raw_rows() -> None:
    logits = torch.randn(3, 8)
    raw = logits.log_softmax(-1)
    out = verify(
        logits.clone(), row(SamplingParams(temperature=0, logprobs=2)), [int(raw[0].argmax())], None
    )
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp is not None
        assert lp[0] == pytest.approx(float(raw[j, token]))
        assert len(lp[1]) >= 2


# -- scheduling -------------------------------------------------------------------------------


def test_drafts_take_budget_and_blocks_and_rejected_slots_are_released() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    proposer = NgramProposer(SpeculativeConfig("ngram", 6, 2, 1), max_model_len=64)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, proposer=proposer.propose)
    req = Request("a", None, [1, 2, 3, 1, 2], SamplingParams(max_tokens=50), frozenset())
    sched.add(req)
    out = sched.schedule()  # the prefill: no drafts
    assert out.scheduled[0].spec_token_ids == []
    sched.on_step_computed(out)
    req.append_token(3)  # context 1 2 3 1 2 3: drafts continue it
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.spec_token_ids == [1, 2, 3]  # what followed the earlier 2 3
    assert s.num_new_tokens == 4  # the last token + 3 drafts
    assert len(kv.block_table("a")) == 3  # 12 slots for 6 + 3 tokens
    # Verification kept one draft and added one token: 8 tokens, 7 computed.
    req.append_token(1)
    req.append_token(9)
    s.num_new_tokens = 2
    sched.on_step_computed(out)
    assert req.num_computed_tokens == 7
    assert len(kv.block_table("a")) == 2  # the block of rejected drafts is back
    assert kv.pool.num_free == 6


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    proposer = NgramProposer(SpeculativeConfig("ngram", 6, 2, 1), max_model_len=64)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, proposer=proposer.propose)
    req = Request("a", None, [1, 2, 1, 2, 1], SamplingParams(max_tokens=50), frozenset())
    sched.add(req)
    sched.on_step_computed(sched.schedule())
    req.append_token(2)
    # Four drafts would need 10 slots of the pool's 8: the step decodes without them.
    assert proposer.propose(req, 31) == [1, 2, 1, 2]
    out = sched.schedule()
    assert out.preempted == []
    assert out.scheduled[0].spec_token_ids == []
    assert out.scheduled[0].num_new_tokens == 1
