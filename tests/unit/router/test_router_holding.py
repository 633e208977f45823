"""The per-model hold queue used while a model has no ready replica."""

from __future__ import annotations

import asyncio

import pytest

from fleetllm.router.holding import HoldQueue, HoldRejected

pytestmark = pytest.mark.asyncio

GUARD = 10.0  # hang guard for the waits below; no test depends on how fast anything is


async def test_waiters_resume_in_arrival_order_once_ready() -> None:
    queue = HoldQueue(max_size=10, recheck=GUARD)
    ready = False
    resumed: list[int] = []

    async def held(i: int) -> None:
        await queue.hold(lambda: ready, GUARD)
        resumed.append(i)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(held(i)))
        await asyncio.sleep(0)
    while len(queue) < 5:
        await asyncio.sleep(0)
    ready = True
    queue.notify()
    await asyncio.wait_for(asyncio.gather(*tasks), GUARD)
    assert resumed == [0, 1, 2, 3, 4]
    assert len(queue) == 0


async def test_a_ready_model_does_not_hold_even_with_a_full_queue() -> None:
    queue = HoldQueue(max_size=0)
    await asyncio.wait_for(queue.hold(lambda: True, GUARD), GUARD)


async def test_beyond_the_bound_a_request_is_rejected_at_once() -> None:
    queue = HoldQueue(max_size=2, recheck=GUARD)
    waiting = [asyncio.create_task(queue.hold(lambda: False, GUARD)) for _ in range(2)]
    while len(queue) < 2:
        await asyncio.sleep(0)
    with pytest.raises(HoldRejected) as excinfo:
        await asyncio.wait_for(queue.hold(lambda: False, GUARD), GUARD)
    assert excinfo.value.reason == "full"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert len(queue) == 0


async def test_the_bound_in_bytes_counts_the_bodies_held_and_frees_them_on_leaving() -> None:
    queue = HoldQueue(max_size=10, max_bytes=1000, recheck=GUARD)
    big = asyncio.create_task(queue.hold(lambda: False, GUARD, size=600))
    while len(queue) < 1:
        await asyncio.sleep(0)
    assert queue.bytes == 600
    with pytest.raises(HoldRejected) as excinfo:
        await asyncio.wait_for(queue.hold(lambda: False, GUARD, size=401), GUARD)
    assert excinfo.value.reason == "full" and len(queue) == 1
    small = asyncio.create_task(queue.hold(lambda: False, GUARD, size=400))
    while len(queue) < 2:
        await asyncio.sleep(0)
    assert queue.bytes == 1000
    for task in (big, small):
        task.cancel()
    await asyncio.gather(big, small, return_exceptions=True)
    assert (len(queue), queue.bytes) == (0, 0)


async def test_the_timeout_rejects_and_leaves_the_queue() -> None:
    queue = HoldQueue(max_size=2, recheck=0.01)
    with pytest.raises(HoldRejected) as excinfo:
        await asyncio.wait_for(queue.hold(lambda: False, 0.05), GUARD)
    assert excinfo.value.reason == "timeout"
    assert len(queue) == 0


async def test_readiness_is_seen_without_a_notification() -> None:
    """A replica's backoff ends without any event: waiters look again every `recheck`."""
    queue = HoldQueue(max_size=2, recheck=0.01)
    flag = asyncio.Event()
    task = asyncio.create_task(queue.hold(flag.is_set, GUARD))
    while len(queue) < 1:
        await asyncio.sleep(0)
    flag.set()
    await asyncio.wait_for(task, GUARD)


async def test_a_cancelled_waiter_frees_its_place() -> None:
    queue = HoldQueue(max_size=1, recheck=GUARD)
    task = asyncio.create_task(queue.hold(lambda: False, GUARD))
    while len(queue) < 1:
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(queue) == 0
    again = asyncio.create_task(queue.hold(lambda: False, GUARD))
    while len(queue) < 1:
        await asyncio.sleep(0)
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)
