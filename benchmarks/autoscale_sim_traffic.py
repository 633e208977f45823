"""The traffic of benchmarks/autoscale_sim.py: the traces (arrival rates over time), requests
drawn from them, and what one replica finishes at full load (the unit the traces are in)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from autoscale_sim_fleet import Replica, ReplicaModel, Request


@dataclass(frozen=True)
class Trace:
    name: str
    rate: Callable[[float], float]
    """Arrivals per second at time t."""
    duration: float
    lo: int


def poisson_arrivals(trace: Trace, peak: float, rng: random.Random) -> list[float]:
    """A non-homogeneous Poisson process by thinning."""
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= trace.duration:
            return times
        if rng.random() < trace.rate(t) / peak:
            times.append(t)


def request_size(rng: random.Random) -> tuple[int, int]:
    """Prompt and output tokens: lognormal around 400 and 120 (a chat workload)."""
    prompt = min(2048, max(16, int(rng.lognormvariate(math.log(400), 0.6))))
    output = min(1024, max(8, int(rng.lognormvariate(math.log(120), 0.6))))
    return prompt, output


def workload(trace: Trace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    peak = max(trace.rate(t) for t in range(int(trace.duration)))
    return [Request(t, *request_size(rng)) for t in poisson_arrivals(trace, peak, rng)]


def replica_capacity(model: ReplicaModel, seconds: float = 3600.0) -> tuple[float, float]:
    """(requests a replica holds, requests it finishes per second) at full load, measured by
    running one simulated replica with a queue that never empties."""
    rng = random.Random(12345)
    replica = Replica(model, "probe", 0.0, 0.0)
    held = []
    finished = 0

    def count(_: Request) -> None:
        nonlocal finished
        finished += 1

    replica.on_finish = count
    t = 0.0
    while t < seconds:
        while len(replica.waiting) < 2 * model.slots:
            replica.waiting.append(Request(0.0, *request_size(rng)))
        t += 1.0
        replica.advance(t)
        held.append(len(replica.running))
    return sum(held) / len(held), finished / seconds


def traces(unit: float) -> list[Trace]:
    """Rates in replicas' worth of load (`unit` requests per second is one replica at full
    load)."""
    return [
        Trace("steady", lambda t: 1.5 * unit, 2400.0, 1),
        Trace(
            "diurnal",
            lambda t: unit * (2.25 - 1.75 * math.cos(2 * math.pi * t / 3600.0)),
            3600.0,
            1,
        ),
        Trace("burst", lambda t: unit * (6.0 if 900 <= t < 1500 else 1.5), 2700.0, 1),
        Trace(
            "spike_after_idle",
            lambda t: unit * (0.5 if t < 300 else 4.0 if 1500 <= t < 1800 else 0.0),
            2400.0,
            0,
        ),
    ]
