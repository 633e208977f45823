"""The CPU engine's thread count: the cores it may use (affinity, cgroup quota), the kernel's
run-queue delay, and the governor that drops a thread while cores are taken and probes for it
again."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine import cpu_threads
from fleetllm.engine.cpu_threads import (
    CONTENDED,
    FIRST_PROBE_S,
    MAX_PROBE_S,
    SUSTAINED,
    WINDOW_S,
    ThreadGovernor,
    cgroup_cpu_limit,
    cores_within,
    run_delay,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "400000 100000\n"}, 4.0),
        ({"cpu.max": "garbage\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.5),
        ({"cpu/cpu.cfs_quota_us": "250000\n"}, None),  # no period: unknown
        ({}, None),
    ],
)
def test_the_cgroup_quota_in_cores(tmp_path, files, limit):
    for name, text in files.items():
        write(tmp_path / name, text)
    assert cgroup_cpu_limit(tmp_path) == limit


@pytest.mark.parametrize(
    ("default", "affinity", "limit", "threads"),
    [
        (8, 16, None, 8),  # torch's default: the physical cores
        (8, 2, None, 2),  # a CPU set of two
        (8, 16, 3.5, 3),  # a container limited to 3.5 cores
        (8, 16, 0.5, 1),  # half a core: still one thread
        (2, 2, 4.0, 2),
    ],
)
def test_threads_are_the_cores_the_process_may_use(default, affinity, limit, threads):
    assert cores_within(default, affinity, limit) == threads


def test_run_delay_sums_the_threads_waits(tmp_path):
    write(tmp_path / "task" / "10" / "schedstat", "5000000 1500000000 40\n")
    write(tmp_path / "task" / "11" / "schedstat", "5000000 250000000 12\n")
    write(tmp_path / "task" / "12" / "schedstat", "truncated\n")  # skipped, not an error
    assert run_delay(tmp_path) == pytest.approx(1.75)
    assert run_delay(tmp_path / "missing") is None


def test_run_delay_of_this_process_is_read():
    delay = run_delay()
    assert delay is None or delay >= 0.0


class Clock:
    """A governor fed `rate` seconds of waiting per second, window after window."""

    def __init__(self, governor: ThreadGovernor) -> None:
        self.governor = governor
        self.now = 0.0
        self.delay = 0.0
        governor.read_delay = lambda: self.delay
        assert governor.observe(self.now) is None  # the first reading only sets the base

    def window(self, rate: float, seconds: float = WINDOW_S) -> int | None:
        self.now += seconds
        self.delay += rate * seconds
        return self.governor.observe(self.now)


def test_quiet_cores_keep_every_thread():
    clock = Clock(ThreadGovernor(4))
    assert all(clock.window(0.01) is None for _ in range(100))
    assert clock.governor.threads == 4


def test_a_lasting_neighbour_takes_threads_down_to_one():
    clock = Clock(ThreadGovernor(3))
    changes = [clock.window(0.7) for _ in range(3 * SUSTAINED)]
    assert [c for c in changes if c is not None] == [2, 1]
    assert changes[SUSTAINED - 1] == 2  # after SUSTAINED windows, not before
    assert clock.governor.threads == 1


def test_a_moment_of_load_is_not_a_neighbour():
    clock = Clock(ThreadGovernor(2))
    for _ in range(20):
        assert all(clock.window(5.0) is None for _ in range(SUSTAINED - 1))
        assert clock.window(0.01) is None
    assert clock.governor.threads == 2


def test_readings_closer_than_a_window_are_not_taken():
    governor = ThreadGovernor(2)
    clock = Clock(governor)
    clock.delay = 100.0  # much waiting, but only a tenth of a window later
    assert governor.observe(WINDOW_S / 10) is None
    assert governor.threads == 2


def shared_until_dropped(clock: Clock) -> None:
    assert [clock.window(0.7) for _ in range(SUSTAINED)][-1] == clock.governor.threads


def test_a_probe_keeps_its_thread_once_the_neighbour_is_gone():
    clock = Clock(ThreadGovernor(2))
    shared_until_dropped(clock)
    assert clock.governor.threads == 1
    assert clock.window(0.0, FIRST_PROBE_S - WINDOW_S) is None  # not yet
    assert clock.window(0.0) == 2  # the probe
    assert all(clock.window(0.01) is None for _ in range(50))  # kept
    assert clock.governor.threads == 2


def test_failed_probes_come_less_often():
    clock = Clock(ThreadGovernor(2))
    shared_until_dropped(clock)
    gaps = []
    last_drop = clock.now
    for _ in range(400):
        changed = clock.window(0.7 if clock.governor.threads == 2 else 0.0)
        if changed == 1:
            gaps.append(clock.now - last_drop)
            last_drop = clock.now
    # Each probe waited twice as long as the one before it, up to the longest interval, and
    # failed in its own window.
    assert gaps[:5] == pytest.approx([k * FIRST_PROBE_S + WINDOW_S for k in (1, 2, 4, 8, 16)])
    assert max(gaps) <= MAX_PROBE_S + WINDOW_S + 1e-9


def test_no_reading_no_decision():
    governor = ThreadGovernor(2, read_delay=lambda: None)
    assert all(governor.observe(t * WINDOW_S) is None for t in range(20))
    assert governor.threads == 2


def test_a_governor_needs_a_thread():
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0)


@settings(max_examples=200, deadline=None)
@given(
    max_threads=st.integers(1, 8),
    windows=st.lists(
        st.tuples(st.floats(0.0, 3.0), st.floats(WINDOW_S / 4, 4 * FIRST_PROBE_S)),
        max_size=80,
    ),
)
def test_the_count_moves_one_thread_at_a_time_within_bounds(max_threads, windows):
    clock = Clock(ThreadGovernor(max_threads))
    threads = max_threads
    for rate, seconds in windows:
        before = clock.governor._last
        changed = clock.window(rate, seconds)
        if changed is None:
            assert clock.governor.threads == threads
            continue
        assert 1 <= changed <= max_threads and abs(changed - threads) == 1
        if changed > threads:  # a probe follows a window without contention only
            assert before is not None
            assert (clock.delay - before[1]) / (clock.now - before[0]) <= CONTENDED
        threads = changed
    assert clock.governor.threads == threads


def test_the_engine_sets_its_threads_on_the_step_thread(monkeypatch):
    """The local executor sets the count before its first step, in the thread that runs the
    steps (OpenMP's thread count belongs to the calling thread), then follows the governor."""
    import torch

    from fleetllm.engine.executor import LocalExecutor
    from fleetllm.engine.worker import WorkerSpec

    set_to: list[int] = []
    waited = [0.0]  # the process's run-queue delay, as the kernel would report it
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(cpu_threads, "run_delay", lambda: waited[0])
    monkeypatch.setattr(cpu_threads, "WINDOW_S", 0.0)
    executor = LocalExecutor.__new__(LocalExecutor)  # no model: only the threads
    executor.spec = WorkerSpec(
        "m", torch.float32, "cpu", 64, 1, 16, num_threads=2, adaptive_threads=True
    )
    executor.threads, executor._threads_set = None, False
    executor._govern_threads()  # the first step: the full count, and a governor
    assert set_to == [2] and executor.threads is not None
    for _ in range(SUSTAINED):
        waited[0] += 5.0  # five seconds waited since the last step, however short it was
        executor._govern_threads()
    assert set_to == [2, 1]


@pytest.mark.parametrize("adaptive", [True, False])
def test_without_a_count_the_step_thread_keeps_what_it_runs_with(monkeypatch, adaptive):
    """A library caller's torch.set_num_threads holds: the engine takes no more threads than
    the thread running its steps has, within the cores the process may use."""
    import torch

    from fleetllm.engine.executor import LocalExecutor
    from fleetllm.engine.worker import WorkerSpec

    before = torch.get_num_threads()
    executor = LocalExecutor.__new__(LocalExecutor)
    executor.spec = WorkerSpec("m", torch.float32, "cpu", 64, 1, 16, adaptive_threads=adaptive)
    executor.threads, executor._threads_set = None, False
    try:
        torch.set_num_threads(1)
        executor._govern_threads()
        assert torch.get_num_threads() == 1
        assert (executor.threads is not None) == adaptive
        if adaptive:
            assert executor.threads.max_threads == 1
    finally:
        torch.set_num_threads(before)


def test_ranks_share_the_usable_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    assert cpu_threads.rank_threads(None, 1) is None  # one rank decides on its step thread
    assert cpu_threads.rank_threads(None, 2) == 4
    assert cpu_threads.rank_threads(None, 16) == 1
    assert cpu_threads.rank_threads(3, 2) == 3  # given: as given
