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
    # Arrival order, so that b, the shorter, is admitted after a.
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, policy="fcfs")
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


def admitted_order(sched: Scheduler, steps: int) -> list[str]:
    """Request ids in the order their prefills were first scheduled, over `steps` steps."""
    seen: list[str] = []
    for _ in range(steps):
        for s in run_step(sched).scheduled:
            if s.request.request_id not in seen:
                seen.append(s.request.request_id)
    return seen


def test_shortest_first_admits_requests_that_arrived_together_by_prompt_length() -> None:
    lengths = {"a": 30, "b": 5, "c": 17, "d": 5, "e": 9}
    orders = {}
    for policy in ("shortest-first", "fcfs"):
        kv = KVCacheManager(64, BS, enable_prefix_caching=False)
        # A budget of 10 tokens: one short prompt (or a chunk) per step, as in a burst.
        sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10, policy=policy)
        for i, (rid, n) in enumerate(lengths.items()):
            sched.add(make(rid, n, start=100 * i))
        orders[policy] = admitted_order(sched, 12)
    # Equal lengths keep their arrival order.
    assert orders["shortest-first"] == ["b", "d", "e", "c", "a"]
    assert orders["fcfs"] == ["a", "b", "c", "d", "e"]


def test_shortest_first_lets_no_long_prompt_starve() -> None:
    """A stream of short prompts overtakes a long one only while they arrive within its own
    prefill time after it (prompt tokens over the step budget, in steps)."""
    kv = KVCacheManager(512, BS, enable_prefix_caching=False)
    # One sequence at a time: each step admits exactly one waiting request.
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=8)
    sched.add(make("long", 24))  # three steps' worth of prefill on its own
    first_step: dict[str, int] = {}
    for step in range(8):
        # Each step a short request arrives: alone, each would always go first.
        sched.add(make(f"short{step}", 2, start=2000 + 10 * step))
        for s in run_step(sched).scheduled:
            first_step.setdefault(s.request.request_id, step)
        sched.remove_finished(list(sched.running))
    overtook = [r for r, at in first_step.items() if r != "long" and at < first_step["long"]]
    # short0..short2 arrived within three steps of it; later ones wait behind it.
    assert overtook == ["short0", "short1", "short2"]
    assert first_step["short3"] == first_step["long"] + 1


def test_preempted_request_is_readmitted_before_later_arrivals() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)  # 16 token slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make("a", 4), make("b", 8, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a (shorter) admitted first; 3 of 4 blocks used
    out = run_step(sched)  # a's 5th token takes the last block; b's 9th finds none
    assert out.preempted == [b]
    sched.add(make("late", 1, start=90))  # shorter than b, but it arrives after it
    sched.remove_finished([a])
    assert admitted_order(sched, 1) == ["b", "late"]
