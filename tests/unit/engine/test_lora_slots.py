"""LoRA slots without a model: a slot held by a running request is never given to another
adapter, free slots are reused least recently used first, loads are sent until a step takes
them, and the scheduler makes a request wait for a slot while the requests behind it run."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.block_manager import KVCacheManager, root_hash
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.lora_adapter import LoRAAdapter
from fleetllm.engine.lora_slots import LoRASlots
from fleetllm.engine.request import Request
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerOutput

MODEL = ModelConfig.from_dict(
    {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
     "num_attention_heads": 4, "vocab_size": 64}
)  # fmt: skip


def adapter(i: int, model: ModelConfig = MODEL, rank: int = 8) -> LoRAAdapter:
    return LoRAAdapter(f"a{i}", f"/adapters/{i}", bytes([i]) * 32, rank, {}, model)


@settings(max_examples=300, deadline=None)
@given(
    max_loras=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60),
)
def test_held_slots_are_never_taken_and_loads_follow_every_change(
    max_loras: int, ops: list[tuple[bool, int]]
) -> None:
    slots = LoRASlots(max_loras, 8)
    held: list[tuple[int, LoRAAdapter]] = []  # (slot, adapter) of each running request
    ranks: dict[int, LoRAAdapter] = {}  # what the ranks hold, after the loads they took
    for acquire, i in ops:
        if acquire or not held:
            a = adapter(i)
            slot = slots.acquire(a)
            in_use = {s: x.key for s, x in held}
            if slot is None:
                # Refused only when every slot is held, none of them by this adapter.
                assert len(in_use) == max_loras and a.key not in in_use.values()
                continue
            assert in_use.get(slot, a.key) == a.key  # never a slot held by another adapter
            held.append((slot, a))
        else:
            slot, _ = held.pop(i % len(held))
            slots.release(slot)
        loads = slots.pending_loads()
        ranks.update(loads)
        slots.loaded(loads)
        # Every running request finds its adapter where the ranks have it.
        for slot, a in held:
            assert ranks[slot].key == a.key


def test_idle_slots_are_reused_least_recently_used_first() -> None:
    slots = LoRASlots(2, 8)
    a, b, c = adapter(1), adapter(2), adapter(3)
    sa, sb = slots.acquire(a), slots.acquire(b)
    assert slots.pending_loads() == {sa: a, sb: b}
    slots.loaded(slots.pending_loads())
    slots.release(sb)
    slots.release(sa)  # a is now the more recently used
    assert slots.acquire(a) == sa and slots.pending_loads() == {}  # still there: no load
    slots.release(sa)
    assert slots.acquire(c) == sb  # b's slot was the least recently used
    assert slots.pending_loads() == {sb: c}
    assert slots.resident() == ["a1", "a3"]


def make(rid: str, lora: LoRAAdapter | None, n: int = 5) -> Request:
    return Request(rid, None, list(range(n)), SamplingParams(), frozenset(), lora=lora)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, then act as the model: sampled requests gain one token."""
    out = sched.schedule()
    sched.on_step_computed(out)
    for s in out.scheduled:
        if s.samples:
            s.request.append_token(1)
    return out


def ids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def test_a_request_waits_for_a_slot_and_the_requests_behind_it_run() -> None:
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    slots = LoRASlots(1, 8)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, lora_slots=slots)
    first, second = make("x", adapter(1)), make("y", adapter(2))
    base, same = make("base", None), make("z", adapter(1))
    for req in (first, second, base, same):
        sched.add(req)
    assert ids(run_step(sched)) == ["x", "base", "z"]  # z shares x's slot
    assert list(sched.waiting) == [second] and second.lora_slot is None
    assert first.lora_slot == same.lora_slot == 0
    sched.remove_finished([first])
    assert ids(run_step(sched)) == ["base", "z"]  # z still holds the one slot
    assert list(sched.waiting) == [second]
    sched.abort(same)
    assert ids(run_step(sched)) == ["base", "y"]
    assert second.lora_slot == 0 and slots.pending_loads() == {0: second.lora}


def test_preemption_gives_the_slot_back() -> None:
    kv = KVCacheManager(2, 4, enable_prefix_caching=False)
    slots = LoRASlots(2, 8)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, lora_slots=slots)
    a, b = make("a", adapter(1), n=4), make("b", adapter(2), n=4)
    sched.add(a)
    sched.add(b)
    assert ids(run_step(sched)) == ["a", "b"]
    held = b.lora_slot
    # Each now needs a second block, and the pool has two: the newest is preempted.
    out = run_step(sched)
    assert out.preempted == [b] and b.lora_slot is None and a.lora_slot is not None
    assert slots.acquire(adapter(3)) == held  # b's slot is free for another adapter


def test_adapters_and_salts_root_separate_chains() -> None:
    keys = [None, b"\1" * 32, b"\2" * 32]
    roots = {root_hash(salt, key) for salt in (None, "s", "t") for key in keys}
    assert len(roots) == 9
    assert root_hash() == root_hash(None, None)


def test_adapters_of_another_model_over_the_rank_or_without_lora_are_refused() -> None:
    slots = LoRASlots(2, 8)
    slots.check(adapter(1), MODEL)
    other = dataclasses.replace(MODEL, hidden_size=64)
    with pytest.raises(ValueError, match="'a1' was read for another model"):
        slots.check(adapter(1, other), MODEL)
    with pytest.raises(ValueError, match="has rank 16, over max_lora_rank 8"):
        slots.check(adapter(1, rank=16), MODEL)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LoRASlots(0, 8).check(adapter(1), MODEL)
