"""Properties of the control law (hypothesis): bounds, the scale-down delay, monotony in load,
no flapping, panic, and unread replicas."""

from __future__ import annotations

import copy
import math
import random

from autoscale_testkit import hist, observe, sample, spec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fleetllm.api.scaling import ScalingSpec
from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.settings import LawSettings
from fleetllm.autoscale.step import Decision, Observation
from fleetllm.scrape import EngineSample

TOL = LawSettings().tolerance

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

replica_load = st.tuples(
    st.floats(0, 1),  # kv usage
    st.integers(0, 16),  # running
    st.integers(0, 40),  # waiting
)


@st.composite
def scalings(draw: st.DrawFn) -> ScalingSpec:
    lo = draw(st.integers(0, 4))
    hi = draw(st.integers(max(lo, 1), 12))
    zero = draw(st.none() | st.integers(1, 120)) if lo == 0 else None
    return spec(
        min_replicas=lo,
        max_replicas=hi,
        scale_down_delay_seconds=draw(st.integers(0, 120)),
        scale_to_zero_after_seconds=zero,
        target_kv_cache_usage=draw(st.floats(0.3, 1.0)),
    )


@st.composite
def step_inputs(draw: st.DrawFn) -> list[tuple[float, list[tuple[float, int, int] | None], int]]:
    """Steps of (seconds since the last, per-replica load or None for unread, finished)."""
    n = draw(st.integers(1, 40))
    return [
        (
            draw(st.sampled_from([1.0, 5.0, 15.0])),
            draw(st.lists(st.none() | replica_load, min_size=0, max_size=12)),
            draw(st.integers(0, 3)),
        )
        for _ in range(n)
    ]


def run(
    s: ScalingSpec,
    steps: list[tuple[float, list[tuple[float, int, int] | None], int]],
    start: int,
    capacity: int | None = 8,
) -> list[tuple[Observation, Decision]]:
    """Feed the steps, each time with the count the previous decision set (replicas become
    ready at once, up to the samples the step has)."""
    law = Autoscaler()
    t, replicas, finished = 0.0, start, 0.0
    out = []
    for dt, loads, done in steps:
        t += dt
        finished += done
        read = loads[:replicas]
        samples = {
            f"r{i}": None
            if load is None
            else sample(t, load[0], load[1], load[2], queue_time=hist({0.5: finished}))
            for i, load in enumerate(read)
        }
        obs = Observation(t, replicas, len(samples), samples, replica_capacity=capacity)
        decision = law.decide(s, obs)
        out.append((obs, decision))
        replicas = decision.replicas
    return out


@PROPERTY
@given(scalings(), step_inputs(), st.integers(0, 15))
def test_decisions_stay_within_bounds(s: ScalingSpec, steps: list, start: int) -> None:
    for obs, d in run(s, steps, start):
        if d.replicas == 0:
            assert s.min_replicas == 0, (obs, d)
        else:
            assert s.min_replicas <= d.replicas <= s.max_replicas, (obs, d)


@PROPERTY
@given(scalings(), step_inputs(), st.integers(1, 15))
def test_no_scale_down_inside_the_delay(s: ScalingSpec, steps: list, start: int) -> None:
    history = run(s, steps, start)
    first = history[0][0].time
    for i, (obs, d) in enumerate(history):
        if d.change != "down":
            continue
        assert obs.time - first >= s.scale_down_delay_seconds
        # Every step of the delay before it, and the one in force when the delay began, was
        # fully read and needed at most where it went.
        start = obs.time - s.scale_down_delay_seconds
        in_force = max((j for j, (p, _) in enumerate(history[:i]) if p.time <= start), default=0)
        for prior, pd in history[in_force : i + 1]:
            if pd.change == "bounds":
                continue
            assert pd.change not in ("up", "from-zero"), (prior, pd)
            assert math.ceil(pd.load.need) <= d.replicas, (prior, pd, d)
            assert all(x is not None for x in prior.samples.values()), (prior, pd)


@PROPERTY
@given(
    scalings(),
    step_inputs(),
    st.integers(1, 12),
    st.lists(replica_load, min_size=1, max_size=12),
    st.floats(1.0, 4.0),
    st.integers(0, 10),
)
def test_monotone_in_load(
    s: ScalingSpec,
    prefix: list,
    replicas: int,
    loads: list[tuple[float, int, int]],
    factor: float,
    extra_waiting: int,
) -> None:
    """After the same history, more load never gets fewer replicas."""
    law = Autoscaler()
    t = 0.0
    for dt, step_loads, _ in prefix:
        t += dt
        samples = {
            f"r{i}": None if x is None else sample(t, x[0], x[1], x[2])
            for i, x in enumerate(step_loads)
        }
        law.decide(s, Observation(t, replicas, len(samples), samples, replica_capacity=8))
    t += 5
    loads = loads[:replicas]

    def last(scale: float, more_waiting: int) -> int:
        samples = {
            f"r{i}": sample(t, min(1.0, kv * scale), run * scale, w * scale + more_waiting)
            for i, (kv, run, w) in enumerate(loads)
        }
        obs = Observation(t, replicas, len(samples), samples, replica_capacity=8)
        return copy.deepcopy(law).decide(s, obs).replicas

    assert last(1.0, 0) <= last(factor, extra_waiting)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 16),
    st.floats(1 - TOL + 0.01, 1 + TOL - 0.01),
    st.floats(0.0, 0.009),
    st.integers(0, 2**32 - 1),
)
def test_noisy_constant_load_inside_the_band_never_flaps(
    n: int, level: float, noise: float, seed: int
) -> None:
    """1000 steps of load whose need stays within the tolerance band of n: n throughout."""
    rng = random.Random(seed)
    s = spec(max_replicas=40, scale_down_delay_seconds=30)
    law = Autoscaler()
    for step in range(1000):
        t = step * 5.0
        per_replica = [
            max(0.0, min(1.0, 0.8 * level * (1 + rng.uniform(-noise, noise)))) for _ in range(n)
        ]
        d = law.decide(s, observe(t, n, per_replica, queue=[hist({0.5: step})] * n))
        assert (d.replicas, d.change) == (n, "none"), (step, d)


@PROPERTY
@given(
    st.integers(1, 10),
    st.integers(1, 32),
    st.integers(0, 200),
    st.integers(11, 60),
)
def test_panic_reaches_the_needed_replicas_in_one_step(
    replicas: int, capacity: int, waiting: int, hi: int
) -> None:
    s = spec(max_replicas=hi)
    running = capacity  # every slot busy
    need = replicas * (running + waiting) / (capacity * s.target_kv_cache_usage)
    assume(need >= LawSettings().panic_factor * replicas)
    d = Autoscaler().decide(
        s,
        observe(0, replicas, [0.5] * replicas, running=running, waiting=waiting, capacity=capacity),
    )
    assert d.panic
    assert d.replicas == min(hi, math.ceil(need))


@PROPERTY
@given(scalings(), step_inputs(), st.integers(1, 15), st.data())
def test_missing_samples_never_scale_down(
    s: ScalingSpec, steps: list, start: int, data: st.DataObject
) -> None:
    """Whenever a ready replica is unread, stale or incomplete, the count does not go down,
    whatever the others say and however long it lasts."""
    law = Autoscaler()
    t, replicas = 0.0, start
    for dt, loads, _ in steps:
        t += dt
        read = loads[:replicas] or [None]
        kind = data.draw(st.sampled_from(["none", "stale", "incomplete", "absent"]))
        samples: dict[str, EngineSample | None] = {
            f"r{i}": None if x is None else sample(t, x[0], 0, 0, queue_time=hist({}))
            for i, x in enumerate(read)
        }
        ready = len(samples)
        if kind == "none":
            samples["gone"] = None
            ready += 1
        elif kind == "stale":
            samples["gone"] = sample(t - 31, 0.0, queue_time=hist({}))
            ready += 1
        elif kind == "incomplete":
            samples["gone"] = EngineSample(time=t, running=0.0, waiting=0.0)
            ready += 1
        else:
            ready += 1  # reported ready, not in the samples at all
        obs = Observation(t, replicas, ready, samples, replica_capacity=8)
        d = law.decide(s, obs)
        if s.min_replicas <= replicas <= s.max_replicas:
            assert d.replicas >= replicas, (obs, d)
        replicas = d.replicas
    # Then every replica reads idle, but an unread step stays in the delay's span: no scale
    # down until it has left it.
    last_unread = t
    while replicas and t + 5 < last_unread + s.scale_down_delay_seconds:
        t += 5
        idle = {f"r{i}": sample(t, 0.0, queue_time=hist({})) for i in range(replicas)}
        d = law.decide(s, Observation(t, replicas, replicas, idle, replica_capacity=8))
        assert d.change != "down", (t, last_unread, d)
        replicas = d.replicas
