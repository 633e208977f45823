"""How many threads a CPU engine computes with: at most the cores it may use, and fewer while
another process takes some of them.

A step is hundreds of parallel regions (every matmul, every kernel), and each region ends when
its slowest thread does. When a thread shares its core with another process (a neighbour pod,
a benchmark client, the server's own work), the scheduler runs it half the time and every
region waits for it; worse, torch's OpenMP threads spin while they wait, which spends the
contended core's fair share on nothing. Measured with a busy loop on one of two cores, the
engine made 110-127 output tok/s on two threads against 214 on one (369 on two when quiet;
docs/benchmarks.md). So the thread count follows what the scheduler reports:

- At start, the cores the process may use: its CPU affinity, and the quota of its cgroup (a
  container's CPU limit: more threads than the quota get throttled all together), at most
  torch's own default (the physical cores).
- While running, `ThreadGovernor` reads how long the process's threads waited for a core
  (`/proc/self/task/*/schedstat`, the kernel's run-queue delay). Quiet, that is about 0.01 s
  per second; with a neighbour on one core, 0.7. Above `CONTENDED` for `SUSTAINED` windows in
  a row, one thread is dropped; the count comes back by a probe (one more thread, kept if the
  wait stays low), at intervals that double while probes fail, so a lasting neighbour costs
  one window now and then.

Pure logic (`ThreadGovernor`) apart from the readings (`cgroup_cpu_limit`, `run_delay`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

WINDOW_S = 1.0
"""Seconds between readings of the run-queue delay."""
CONTENDED = 0.25
"""Seconds waited for a core per second (summed over the threads) above which the cores count
as shared: a quarter of a core; quiet, the engine's threads wait about 0.01."""
SUSTAINED = 2
"""Shared windows in a row before a thread is dropped: a moment's load (another process
starting, a burst of requests to parse) is not a neighbour."""
FIRST_PROBE_S = 4.0
"""Seconds after dropping a thread before one more is tried."""
MAX_PROBE_S = 320.0
"""The longest interval between probes while they keep failing."""


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (a container's CPU limit), or None when
    unlimited or unknown. cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); a container sees
    its own cgroup at the root."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _cores(int(quota), int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _cores(quota_us, period_us)


def _cores(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def usable_cores() -> int:
    """Threads for a CPU engine on this machine (`cores_within` what torch, the affinity and
    the cgroup say)."""
    return cores_within(torch.get_num_threads(), len(os.sched_getaffinity(0)), cgroup_cpu_limit())


def rank_threads(given: int | None, ranks: int) -> int | None:
    """Threads per rank: as given; else for several ranks (processes of their own) a share of
    the usable cores; for one rank None: it decides at its first step, on the thread that
    runs the steps, within what that thread runs with (a library caller's
    torch.set_num_threads holds)."""
    if given is not None or ranks == 1:
        return given
    return max(1, usable_cores() // ranks)


def cores_within(default_threads: int, affinity: int, limit: float | None) -> int:
    """torch's default thread count (the physical cores), no more than the CPUs the process's
    affinity allows nor its cgroup's quota (`limit`, in cores, rounded down); at least one."""
    cores = min(default_threads, affinity)
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def run_delay(proc: Path = Path("/proc/self")) -> float | None:
    """Seconds this process's threads have waited on a run queue, summed; None where the
    kernel does not report it."""
    total = 0
    try:
        tasks = list((proc / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


class ThreadGovernor:
    """The thread count for `max_threads` cores shared with whoever else runs there; call
    `observe` before each step, apply what it returns."""

    def __init__(
        self, max_threads: int, read_delay: Callable[[], float | None] | None = None
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self.read_delay = read_delay or run_delay
        self._last: tuple[float, float] | None = None  # (time, delay) of the last reading
        self._probe_after = FIRST_PROBE_S
        self._next_probe: float | None = None
        self._probing = False
        self._shared = 0  # shared windows in a row

    def observe(self, now: float) -> int | None:
        """The new thread count when it changes at `now` (monotonic seconds), else None."""
        if self._last is not None and now - self._last[0] < WINDOW_S:
            return None
        delay = self.read_delay()
        if delay is None:
            return None
        last, self._last = self._last, (now, delay)
        if last is None:
            return None
        waited = (delay - last[1]) / (now - last[0])
        return self._decide(now, waited)

    def _decide(self, now: float, waited: float) -> int | None:
        self._shared = self._shared + 1 if waited > CONTENDED else 0
        # A probe's own window tells at once: the thread it added is what waits.
        if self._shared >= SUSTAINED or (self._shared and self._probing):
            if self._probing:  # the probe found the cores still shared: wait longer
                self._probe_after = min(2 * self._probe_after, MAX_PROBE_S)
                self._probing = False
            if self.threads == 1:
                return None
            self._shared = 0
            self.threads -= 1
            self._next_probe = now + self._probe_after
            return self.threads
        if waited > CONTENDED:
            return None  # shared for a moment so far
        if self._probing:  # a window without contention: the probe's thread stays
            self._probing = False
            self._probe_after = FIRST_PROBE_S
            self._next_probe = now + FIRST_PROBE_S if self.threads < self.max_threads else None
        if self._next_probe is not None and now >= self._next_probe:
            self.threads += 1
            self._probing = True
            self._next_probe = None
            return self.threads
        return None
