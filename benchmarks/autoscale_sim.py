"""Discrete-event fleet simulator: fleetllm's autoscaling law against the laws of KubeAI, the
vLLM production stack's KEDA set-up and AIBrix's KPA, and a static fleet at maxReplicas.

Every law drives the same simulated fleet through the same traces (steady, diurnal, a 4x
burst, a spike after idle), and the run prints, per trace and law, the queue-time SLO
attainment (share of requests that waited less than targetQueueTimeSeconds from arrival to
their first scheduling, router hold included) and the replica-seconds paid (from a replica's
creation, start-up included, to its removal). Its last line is the burst trace:

    burst slo ours=0.xx kubeai=0.xx keda=0.xx kpa=0.xx replica_s ours=N kubeai=N keda=N kpa=N

Ours is the real law (`fleetllm.operator.autoscale.Autoscaler`), fed `EngineSample`s exactly as
the operator feeds it. Deterministic for a seed.

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

The baselines, each as its project documents it:
- KubeAI: every 10 s, the moving average of the last 60 samples (10 minutes; the history
  starts at zeros) of the requests in flight through its proxy, over targetRequests per replica,
  rounded up; scale down only after 3 consecutive lower results (scaleDownDelaySeconds 30).
  targetRequests is set to 0.8 x the requests a replica holds at once (the same utilisation
  target as ours).
- KEDA (the vLLM production stack's ScaledObject): Prometheus query vllm:num_requests_waiting
  (summed over pods), threshold 5, pollingInterval 15 s, cooldownPeriod 360 s; the HPA KEDA
  drives computes ceil(waiting / 5) with its 10 % tolerance, scales up by at most max(100 %,
  4 pods) a period, and takes the highest recommendation of the last 360 s when scaling down
  (the cooldown as the production stack describes it: the wait before scaling down).
- AIBrix KPA: the Knative algorithm on vllm:gpu_cache_usage_perc with target 0.8 per pod (ours),
  evaluated every 2 s: desired = ceil(mean total KV usage over the stable window (180 s) /
  target); panic when the panic-window (60 s) figure reaches 2x the ready pods, in which the
  count never goes down, until a stable window passes without panic; scale-up rate 1000x,
  scale-down rate at most halving a step.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetllm.api.scaling import ScalingSpec
from fleetllm.engine.metrics import REQUEST_LATENCY_BUCKETS
from fleetllm.operator.autoscale import Autoscaler, Observation
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


# -- the laws -----------------------------------------------------------------------------------


class Ours(Law):
    name = "ours"

    def __init__(self, spec: ScalingSpec, period: float, capacity: int) -> None:
        self.spec = spec
        self.period = period
        self.capacity = capacity
        self.law = Autoscaler()

    def decide(self, view: FleetView) -> int:
        obs = Observation(
            time=view.time,
            replicas=view.replicas,
            ready_replicas=len(view.samples),
            samples=view.samples,
            replica_capacity=self.capacity,
            demand_time=view.demand_time,
        )
        return self.law.decide(self.spec, obs).replicas


class KubeAI(Law):
    name = "kubeai"
    period = 10.0

    def __init__(self, lo: int, hi: int, target_requests: float) -> None:
        self.lo, self.hi = lo, hi
        self.target = target_requests
        self.history = deque([0.0] * 60, maxlen=60)  # 10 minutes of 10 s samples
        self.required_downs = math.ceil(30 / self.period)
        self.downs = 0

    def decide(self, view: FleetView) -> int:
        if not view.samples:
            return view.replicas  # no endpoints: KubeAI skips the model
        self.history.append(float(view.in_flight))
        desired = math.ceil(sum(self.history) / len(self.history) / self.target)
        desired = min(self.hi, max(self.lo, desired))
        if desired < view.replicas:
            if self.downs < self.required_downs:
                self.downs += 1
                return view.replicas
        else:
            self.downs = 0
        return desired


class Keda(Law):
    name = "keda"
    period = 15.0

    def __init__(self, lo: int, hi: int, threshold: float = 5.0, cooldown: float = 360.0) -> None:
        self.lo, self.hi = lo, hi
        self.threshold = threshold
        self.cooldown = cooldown
        self.recommendations: deque[tuple[float, int]] = deque()
        self.last_active = -math.inf

    def decide(self, view: FleetView) -> int:
        current = view.replicas
        waiting = sum(s.waiting or 0.0 for s in view.samples.values())
        if waiting > 0 or (view.demand_time is not None and view.demand_time > self.last_active):
            self.last_active = view.time
        if current == 0:
            return 0  # activation comes through the router's scale from zero
        if self.lo == 0 and view.time - self.last_active >= self.cooldown:
            return 0
        if current and abs(waiting / (self.threshold * current) - 1) <= 0.1:
            raw = current
        else:
            raw = math.ceil(waiting / self.threshold)
        raw = min(self.hi, max(self.lo, raw, 1))
        self.recommendations.append((view.time, raw))
        while self.recommendations[0][0] < view.time - self.cooldown:
            self.recommendations.popleft()
        if raw > current:
            return min(raw, max(2 * current, current + 4))
        return min(current, max(r for _, r in self.recommendations))


class Kpa(Law):
    name = "kpa"
    period = 2.0

    def __init__(self, lo: int, hi: int, target: float) -> None:
        self.lo, self.hi = lo, hi
        self.target = target
        self.stable_window, self.panic_window = 180.0, 60.0
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_time: float | None = None
        self.max_panic = 0
        self.last_traffic = -math.inf

    def decide(self, view: FleetView) -> int:
        ready = len(view.samples)
        total = sum(s.kv_cache_usage or 0.0 for s in view.samples.values())
        if total > 0 or view.in_flight > 0:
            self.last_traffic = view.time
        if ready == 0:
            return view.replicas
        self.samples.append((view.time, total))
        while self.samples[0][0] <= view.time - self.stable_window:
            self.samples.popleft()
        stable = [v for _, v in self.samples]
        panic = [v for t, v in self.samples if t > view.time - self.panic_window]
        want_stable = math.ceil(sum(stable) / len(stable) / self.target)
        want_panic = math.ceil(sum(panic) / len(panic) / self.target)
        if want_panic / ready >= 2.0:
            self.panic_time = view.time
        elif self.panic_time is not None and view.time - self.panic_time >= self.stable_window:
            self.panic_time, self.max_panic = None, 0
        if self.panic_time is not None:
            self.max_panic = max(self.max_panic, want_panic)
            desired = max(self.max_panic, view.replicas)
        else:
            desired = want_stable
        desired = min(desired, 1000 * ready)
        desired = max(desired, math.floor(ready / 2))
        if self.lo == 0 and view.time - self.last_traffic >= self.stable_window:
            return 0
        return min(self.hi, max(self.lo, desired, 1))


class Static(Law):
    name = "static"
    period = 3600.0

    def __init__(self, n: int) -> None:
        self.n = n

    def decide(self, view: FleetView) -> int:
        return self.n


# -- traces and the run --------------------------------------------------------------------------


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


@dataclass
class Result:
    slo: float
    replica_seconds: float
    mean_replicas: float
    p90_queue: float


def simulate(
    trace: Trace,
    law: Law,
    model: ReplicaModel,
    start: int,
    startup: float,
    hi: int,
    target_queue: float,
    seed: int,
) -> Result:
    requests = workload(trace, seed)
    fleet = Fleet(model, law, start, startup, hi, seed)
    arrivals = deque(requests)
    t_tick = 0.0
    end = trace.duration
    t = 0.0
    while True:
        next_event = fleet.events[0][0] if fleet.events else math.inf
        next_arrival = arrivals[0].arrival if arrivals else math.inf
        t = min(next_event, next_arrival, t_tick)
        busy = fleet.in_flight > 0 or arrivals
        if t == math.inf or (t > end and not busy):
            break
        if t == next_arrival:
            fleet.advance(t)
            fleet.arrive(t, arrivals.popleft())
        elif t == next_event:
            _, _, kind, replica = heapq.heappop(fleet.events)
            if kind == "ready" and replica is not None:
                fleet.became_ready(t, replica)
        else:
            fleet.advance(t)
            fleet.tick(t)
            t_tick += law.period
        if t > 10 * trace.duration:
            raise RuntimeError(f"{trace.name}/{law.name}: the fleet never drained")
    waits = sorted((r.admitted if r.admitted is not None else t) - r.arrival for r in requests)
    slo = sum(w < target_queue for w in waits) / max(1, len(waits))
    rs = fleet.replica_seconds(trace.duration)
    p90 = waits[int(0.9 * (len(waits) - 1))] if waits else 0.0
    return Result(slo, rs, rs / trace.duration, p90)


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


def measure() -> None:
    """Fit the replica model to our engine: decode step time against the batch, prefill speed
    (one thread, CPU time)."""
    import time

    import torch

    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling_params import SamplingParams

    with open("/proc/cpuinfo") as cpuinfo:
        words = set(cpuinfo.read().split())
    flags = sorted(words & {"avx2", "avx512f", "avx512_bf16"})
    print(f"CPU flags: {' '.join(flags) or 'none of avx2/avx512f/avx512_bf16'}", flush=True)
    torch.set_num_threads(1)
    llm = LLM(
        "smollm2-135m",
        dtype="bfloat16",
        num_threads=1,
        max_num_seqs=32,
        num_kv_blocks=800,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)

    def run(batch: int, prompt: int, output: int) -> float:
        prompts = [[rng.randrange(1000, 40000) for _ in range(prompt)] for _ in range(batch)]
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
        started = time.process_time()
        llm.generate(prompts, params)
        return time.process_time() - started

    run(2, 64, 4)
    points = []
    for batch in (1, 8, 24):
        prefill = run(batch, 512, 1)
        decode = (run(batch, 512, 65) - prefill) / 64
        points.append((batch, decode))
        print(
            f"batch {batch}: prefill {batch * 512 / prefill:.0f} tokens/s, "
            f"decode step {decode * 1000:.1f} ms",
            flush=True,
        )
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / sum(
        (b - mean_b) ** 2 for b, _ in points
    )
    print(f"step time = {mean_s - slope * mean_b:.4f} + {slope:.5f} x batch seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup", type=float, default=60.0, help="replica start-up seconds")
    parser.add_argument("--max-replicas", type=int, default=10)
    parser.add_argument("--target-queue", type=float, default=1.0)
    parser.add_argument("--period", type=float, default=5.0, help="our law's period (s)")
    parser.add_argument(
        "--scale-down-delay",
        type=int,
        default=ScalingSpec.model_fields["scale_down_delay_seconds"].default,
        help="our scaleDownDelaySeconds (default: the CRD's)",
    )
    parser.add_argument("--measure", action="store_true", help="measure the replica model")
    args = parser.parse_args(argv)
    if args.measure:
        measure()
        return 0

    model = ReplicaModel()
    held, unit = replica_capacity(model)
    print(
        f"replica: {model.slots} slots, {model.kv_tokens} KV tokens, decode step "
        f"{model.step_base * 1000:.1f} + {model.step_per_seq * 1000:.2f} x batch ms, prefill "
        f"{model.prefill_tokens_per_s:.0f} tokens/s; holds ~{held:.1f} requests, "
        f"~{unit:.2f} requests/s at full load; start-up {args.startup:.0f}s"
    )
    hi = args.max_replicas
    results: dict[str, dict[str, Result]] = {}
    for trace in traces(unit):
        lo = trace.lo
        spec = ScalingSpec(
            min_replicas=lo,
            max_replicas=hi,
            target_kv_cache_usage=0.8,
            target_queue_time_seconds=args.target_queue,
            scale_down_delay_seconds=args.scale_down_delay,
            scale_to_zero_after_seconds=600 if lo == 0 else None,
        )
        laws: list[Law] = [
            Ours(spec, args.period, model.slots),
            KubeAI(lo, hi, 0.8 * held),
            Keda(lo, hi),
            Kpa(lo, hi, 0.8),
            Static(hi),
        ]
        print(f"\n{trace.name} ({trace.duration:.0f}s)")
        print(f"{'law':8} {'slo':>6} {'replica_s':>10} {'mean':>6} {'p90 queue':>10}")
        results[trace.name] = {}
        for law in laws:
            start = hi if isinstance(law, Static) else 1
            r = simulate(trace, law, model, start, args.startup, hi, args.target_queue, args.seed)
            results[trace.name][law.name] = r
            print(
                f"{law.name:8} {r.slo:6.3f} {r.replica_seconds:10.0f} "
                f"{r.mean_replicas:6.2f} {r.p90_queue:9.2f}s",
                flush=True,
            )
    burst = results["burst"]
    names = ("ours", "kubeai", "keda", "kpa")
    print(
        "burst slo "
        + " ".join(f"{n}={burst[n].slo:.2f}" for n in names)
        + " replica_s "
        + " ".join(f"{n}={burst[n].replica_seconds:.0f}" for n in names)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
