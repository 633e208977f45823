"""The simulated fleet of benchmarks/autoscale_sim.py: its replicas and its router.

The replica. fleetllm's engine serving SmolLM2-135M in bfloat16 on one CPU core, with a KV
pool of 800 blocks of 16 tokens and 32 sequence slots (`--dtype bfloat16 --num-kv-blocks 800
--max-num-seqs 32 --max-num-batched-tokens 512`), so that, as on GPUs, the KV cache fills
before the slots do. Decode step time `a + b x batch` and prefill speed are what
`python benchmarks/autoscale_sim.py --measure` printed on an AVX512-BF16 machine (one thread,
CPU time, so other load on the machine does not inflate them): decode steps of 44.8, 102.0 and
319.7 ms at batch 1, 8 and 24 (fit: 20.9 + 12.24 x batch ms) and 529-539 prompt tokens/s;
they are the defaults of `ReplicaModel`. What one replica
finishes per second at full load is measured by simulating one replica with a queue that never
empties; traces are in multiples of it. A new replica serves after `--startup` seconds (60 by
default: an assumption for pulling and loading a model, not a measurement). The engine is
modelled as vLLM schedules: FIFO admission while a slot is free and the KV pool holds the
prompt; every running request gains one token per decode step; a new request's prefill stalls
the batch for its prompt; when the pool is full the latest admitted request is preempted (its
tokens freed, recomputed later). `vllm:kv_cache_usage_perc` is the share of the pool in use, and
`request_queue_time_seconds` is observed when a request finishes, as in vLLM.

The fleet. A router sends each request to the ready replica with the fewest requests in it,
holds requests while no replica is ready and then asks for one replica (the router's scale
from zero, the same for every law). A new replica serves after `--startup` seconds. Scaling
down removes replicas still starting first, then the ready ones with the fewest requests
(pod-deletion-cost); a removed replica takes no new requests and finishes the ones it has.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetllm.engine.metrics import REQUEST_LATENCY_BUCKETS
from fleetllm.scrape import EngineSample, Histogram

# -- the replica --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaModel:
    """One replica of our engine (figures from `--measure`, see the module docstring)."""

    step_base: float = 0.0209
    """Decode step time at batch 0 (seconds)."""
    step_per_seq: float = 0.01224
    """Added decode step time per running sequence (seconds)."""
    prefill_tokens_per_s: float = 533.0
    slots: int = 32
    kv_tokens: int = 800 * 16

    def step_time(self, batch: int) -> float:
        return self.step_base + self.step_per_seq * batch


@dataclass(eq=False)
class Request:
    arrival: float
    prompt: int
    output: int
    done: float = 0.0
    """Output tokens generated so far (fractional: the fluid model advances continuously)."""
    admitted: float | None = None
    """First scheduling: the end of its queue time."""
    finished: float | None = None


QUEUE_BOUNDS = (*REQUEST_LATENCY_BUCKETS, math.inf)


@dataclass(eq=False)
class Replica:
    model: ReplicaModel
    name: str
    created: float
    ready_at: float
    removed_at: float | None = None
    draining: bool = False
    now: float = 0.0
    stall_until: float = 0.0
    running: list[Request] = field(default_factory=list)
    waiting: deque[Request] = field(default_factory=deque)
    used: float = 0.0
    """KV tokens in use."""
    emptied_at: float = 0.0
    """When it last finished its last request."""
    queue_counts: list[int] = field(default_factory=lambda: [0] * len(QUEUE_BOUNDS))
    queue_sum: float = 0.0
    on_finish: Callable[[Request], None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    def _admit(self) -> None:
        m = self.model
        while self.waiting and len(self.running) < m.slots:
            request = self.waiting[0]
            held = request.prompt + request.done
            if self.used + held + 0.01 * m.kv_tokens > m.kv_tokens:  # vLLM's 1 % watermark
                break
            self.waiting.popleft()
            if request.admitted is None:
                request.admitted = self.now
            self.running.append(request)
            self.used += held
            self.stall_until = max(self.now, self.stall_until) + held / m.prefill_tokens_per_s

    def advance(self, t: float) -> None:
        """Run the engine up to time t."""
        m = self.model
        while True:
            self._admit()
            batch = len(self.running)
            start = max(self.now, self.stall_until)
            if batch == 0:
                self.now = self.stall_until = max(self.now, t)
                return
            if start >= t:
                self.now = t  # still prefilling
                return
            rate = 1.0 / m.step_time(batch)  # tokens per second per request
            to_finish = min(r.output - r.done for r in self.running) / rate
            to_full = max(0.0, m.kv_tokens - self.used) / (batch * rate)
            dt = min(to_finish, to_full, t - start)
            for r in self.running:
                r.done += dt * rate
            self.used += batch * dt * rate
            self.now = start + dt
            if dt == to_finish:
                finished = [r for r in self.running if r.output - r.done <= 1e-9]
                for r in finished:
                    self.running.remove(r)
                    self.used -= r.prompt + r.done
                    r.finished = self.now
                    self._observe(r)
                if not self.running:
                    self.used = 0.0  # no drift from the fluid sums
                    if not self.waiting:
                        self.emptied_at = self.now
            elif dt == to_full and dt < t - start:
                # The pool is full: preempt the latest admitted, to be recomputed.
                victim = self.running.pop()
                self.used -= victim.prompt + victim.done
                victim.done = 0.0
                self.waiting.appendleft(victim)
            else:
                return

    def _observe(self, r: Request) -> None:
        assert r.admitted is not None
        wait = r.admitted - r.arrival
        self.queue_counts[bisect.bisect_left(QUEUE_BOUNDS, wait)] += 1
        self.queue_sum += wait
        if self.on_finish is not None:
            self.on_finish(r)

    def sample(self, t: float) -> EngineSample:
        cumulative, total = [], 0
        for le, count in zip(QUEUE_BOUNDS, self.queue_counts, strict=True):
            total += count
            cumulative.append((le, float(total)))
        return EngineSample(
            time=t,
            running=float(len(self.running)),
            waiting=float(len(self.waiting)),
            kv_cache_usage=min(1.0, self.used / self.model.kv_tokens),
            queue_time=Histogram(tuple(cumulative), count=float(total), sum=self.queue_sum),
        )


# -- the fleet --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetView:
    """What a law sees at a tick."""

    time: float
    replicas: int
    """Replicas wanted (not draining)."""
    samples: dict[str, EngineSample]
    """Of the ready replicas."""
    in_flight: int
    """Requests in the fleet: held by the router, waiting or running in a replica."""
    demand_time: float | None


class Law:
    name = ""
    period = 10.0

    def decide(self, view: FleetView) -> int:
        raise NotImplementedError


class Fleet:
    def __init__(
        self, model: ReplicaModel, law: Law, start: int, startup: float, hi: int, seed: int
    ) -> None:
        self.model = model
        self.law = law
        self.startup = startup
        self.hi = hi
        self.replicas: list[Replica] = []
        self.gone: list[Replica] = []
        self.held: deque[Request] = deque()
        self.demand_time: float | None = None
        self.in_flight = 0
        self.events: list[tuple[float, int, str, Replica | None]] = []
        self._seq = 0
        self._names = 0
        self.rng = random.Random(seed)
        for _ in range(start):
            self._add(0.0, ready_at=0.0)

    def _push(self, t: float, kind: str, replica: Replica | None = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, replica))

    def _add(self, t: float, ready_at: float) -> None:
        self._names += 1
        replica = Replica(self.model, f"r{self._names}", t, ready_at, now=t, stall_until=t)
        replica.on_finish = self._finished
        self.replicas.append(replica)
        if ready_at > t:
            self._push(ready_at, "ready", replica)

    def _finished(self, _: Request) -> None:
        self.in_flight -= 1

    def serving(self, t: float) -> list[Replica]:
        return [r for r in self.replicas if not r.draining and r.ready_at <= t]

    def wanted(self) -> int:
        return sum(not r.draining for r in self.replicas)

    def advance(self, t: float) -> None:
        for r in self.replicas:
            if r.ready_at <= t:
                r.advance(t)
        for r in [r for r in self.replicas if r.draining and r.in_flight == 0]:
            r.removed_at = max(r.emptied_at, r.created)
            self.replicas.remove(r)
            self.gone.append(r)

    def arrive(self, t: float, request: Request) -> None:
        self.in_flight += 1
        ready = self.serving(t)
        if not ready:
            self.held.append(request)
            if self.demand_time is None or t - self.demand_time >= 5.0:
                self.demand_time = t
                if self.wanted() == 0:
                    self.scale(t, 1)  # the router writes replicas: 1 (scale from zero)
            return
        best = min(ready, key=lambda r: (r.in_flight, r.name))
        best.waiting.append(request)
        best.advance(t)

    def became_ready(self, t: float, replica: Replica) -> None:
        if replica.draining or replica not in self.replicas:
            return
        replica.now = replica.stall_until = t
        while self.held:
            self.arrive_held(t)
        self.advance(t)

    def arrive_held(self, t: float) -> None:
        request = self.held.popleft()
        ready = self.serving(t)
        best = min(ready, key=lambda r: (r.in_flight, r.name))
        best.waiting.append(request)

    def tick(self, t: float) -> None:
        view = FleetView(
            time=t,
            replicas=self.wanted(),
            samples={r.name: r.sample(t) for r in self.serving(t)},
            in_flight=self.in_flight,
            demand_time=self.demand_time,
        )
        self.scale(t, max(0, min(self.hi, self.law.decide(view))))

    def scale(self, t: float, desired: int) -> None:
        current = [r for r in self.replicas if not r.draining]
        for _ in range(desired - len(current)):
            self._add(t, ready_at=t + self.startup)
        surplus = len(current) - desired
        if surplus <= 0:
            return
        # Not ready ones first, then the ones with the fewest requests (pod-deletion-cost).
        order = sorted(current, key=lambda r: (r.ready_at <= t, r.in_flight, r.name))
        for r in order[:surplus]:
            r.draining = True
            if r.ready_at > t:
                r.removed_at = t
                self.replicas.remove(r)
                self.gone.append(r)

    def replica_seconds(self, horizon: float) -> float:
        """Paid within [0, horizon]."""
        total = 0.0
        for r in [*self.gone, *self.replicas]:
            until = horizon if r.removed_at is None else min(horizon, r.removed_at)
            total += max(0.0, until - r.created)
        return total
