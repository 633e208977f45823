"""Scheduling decisions without a model: budgets, chunked prefill, admission, preemption."""

from __future__ import annotations

from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.request import Request, RequestStatus
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make(rid: str, n_prompt: int, start: int = 0) -> Request:
    return Request(rid, None, list(range(start, start + n_prompt)), SamplingParams(), frozenset())


def run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, then act as the model: sampled requests gain one token."""
    out = sched.schedule()
    sampling = [s.request for s in out.scheduled if s.samples]
    sched.on_step_computed(out)
    for req in sampling:
        req.append_token(1)
    return out


def planned(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_chunked_prefill_and_decode_share_a_step() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(make("a", 3))
    assert planned(run_step(sched)) == {"a": 3}
    sched.add(make("b", 25, start=100))
    # a decodes (1 token), b takes the remaining 9 of the budget as its first chunk.
    assert planned(run_step(sched)) == {"a": 1, "b": 9}
    out = run_step(sched)
    assert planned(out) == {"a": 1, "b": 9}
    assert not next(s for s in out.scheduled if s.request.request_id == "b").samples
    out = run_step(sched)
    assert planned(out) == {"a": 1, "b": 7}
    assert all(s.samples for s in out.scheduled)


def test_max_num_seqs_caps_admission() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make(f"r{i}", 2, start=10 * i))
    assert set(planned(run_step(sched))) == {"r0", "r1"}
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_pool_exhaustion_preempts_most_recently_admitted() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)  # 16 token slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make("a", 8), make("b", 4, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 8 tokens in 2 blocks, b: 4 tokens in 1 block; 3 of 4 used
    assert kv.usage() == 3 / 4
    out = run_step(sched)  # a's 9th token takes the last block; b's 5th finds none
    assert [r.request_id for r in out.preempted] == ["b"]
    assert sched.num_preemptions == 1
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    assert a.status is RequestStatus.RUNNING
    # b keeps its generated token and is recomputed once a finishes.
    generated = len(b.output_token_ids)
    assert generated == 1
    sched.remove_finished([a])
    a.status = RequestStatus.FINISHED
    out = run_step(sched)
    assert planned(out) == {"b": b.num_prompt_tokens + generated}
    sched.remove_finished([b])
    assert kv.usage() == 0.0


def test_no_new_admissions_in_a_step_that_preempted() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make("a", 4), make("b", 4, start=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 2 blocks used (each prompt fills one block exactly)
    sched.add(make("c", 1, start=40))
    out = run_step(sched)  # a and b each need a 2nd block: only 1 left -> b preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert "c" not in planned(out)


def test_abort_frees_blocks_of_running_and_waiting() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = make("a", 6), make("b", 6, start=30)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert kv.usage() > 0
    sched.abort(a)
    sched.abort(b)
    assert not sched.has_unfinished()
    assert kv.usage() == 0.0


def test_prefix_hits_are_counted_in_tokens() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make("a", 10))
    run_step(sched)
    sched.add(make("b", 10))
    out = run_step(sched)
    # b: 2 full blocks (8 tokens) cached; 2 tokens computed.
    assert planned(out)["b"] == 2
    assert kv.prefix_queries == 20
    assert kv.prefix_hits == 8
