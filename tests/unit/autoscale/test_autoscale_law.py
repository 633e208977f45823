"""The control law, case by case: what it decides, and why, for loads worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
from autoscale_testkit import Fleet, hist, observe, spec

from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.settings import LawSettings
from fleetllm.autoscale.step import Decision, Observation


def test_high_kv_usage_scales_up_at_most_twice_a_step() -> None:
    law = Autoscaler()
    d = law.decide(spec(), observe(0, 1, [1.0]))
    assert (d.previous, d.replicas, d.change) == (1, 2, "up")
    assert "KV cache 1.00 (target 0.80)" in d.reason
    assert d.summary == f"1 -> 2: {d.reason}"
    # The added replica is starting: the same load asks for nothing more.
    d = law.decide(spec(), observe(5, 2, [1.0]))
    assert (d.replicas, d.change) == (2, "none")


def test_slots_and_waiting_requests_need_replicas_kv_does_not_show() -> None:
    law = Autoscaler()
    d = law.decide(spec(), observe(0, 2, [0.3, 0.3], running=8, waiting=4, capacity=8))
    # (2 x 8 running + 2 x 4 waiting) / (8 slots x 0.8) = 3.75 -> 4
    assert (d.replicas, d.change) == (4, "up")
    assert d.load.need == pytest.approx(3.75)


def test_queue_time_over_target_scales_up_when_requests_wait() -> None:
    law = Autoscaler()
    queue = [hist({}), hist({})]
    law.decide(spec(), observe(0, 2, [0.5, 0.5], queue=queue))
    slow = [hist({2.0: 10}), hist({2.0: 10})]  # 20 requests queued 1..2 s
    d = law.decide(spec(), observe(5, 2, [0.5, 0.5], waiting=1, queue=slow))
    assert d.load.queue_time_p90 == pytest.approx(1.9)
    assert (d.replicas, d.change) == (4, "up")
    assert "p90 queue time 1.90s (target 1s)" in d.reason
    # Nothing waits now: the recent queue times are history, not a reason to add more.
    law2 = Autoscaler()
    law2.decide(spec(), observe(0, 2, [0.5, 0.5], queue=queue))
    assert law2.decide(spec(), observe(5, 2, [0.5, 0.5], queue=slow)).change == "none"


def test_panic_on_queue_time_far_above_target_jumps_to_the_need() -> None:
    law = Autoscaler()
    queue = [hist({})] * 2
    law.decide(spec(), observe(0, 2, [0.5, 0.5], queue=queue))
    very_slow = [hist({5.0: 20})] * 2
    d = law.decide(
        spec(), observe(5, 2, [0.9, 0.9], running=8, waiting=20, capacity=8, queue=very_slow)
    )
    assert d.panic
    # (16 running + 40 waiting) / 6.4 = 8.75 -> 9 at once, past the x2 step bound.
    assert (d.replicas, d.change) == (9, "up")
    assert d.reason.startswith("panic: ")


def test_scale_down_waits_for_the_delay_then_goes_to_the_highest_recommendation() -> None:
    law = Autoscaler()
    s = spec(scale_down_delay_seconds=60)
    for t in range(0, 60, 5):
        d = law.decide(s, observe(t, 4, [0.1, 0.1, 0.2, 0.2]))
        assert d.replicas == 4, t
    d = law.decide(s, observe(60, 4, [0.1, 0.1, 0.2, 0.2]))
    assert (d.replicas, d.change) == (1, "down")
    # A busy moment inside the delay holds the count until it leaves the window.
    law = Autoscaler()
    for t in range(0, 65, 5):
        kv = [0.8] * 4 if t == 30 else [0.1] * 4
        d = law.decide(s, observe(t, 4, kv))
        assert d.replicas == 4, t
    assert law.decide(s, observe(95, 4, [0.1] * 4)).replicas == 1


def test_a_lower_run_counts_only_once_it_has_lasted_the_whole_delay() -> None:
    # Steps 5 s apart, a 12 s delay: the busy step at 0 is still the one in force at 3, so
    # the idle steps at 5, 10 and 15 have lasted 10 s, not 12, and hold the count.
    law = Autoscaler()
    s = spec(scale_down_delay_seconds=12)
    assert law.decide(s, observe(0, 4, [0.8] * 4)).replicas == 4
    for t in (5, 10, 15):
        assert law.decide(s, observe(t, 4, [0.1] * 4)).replicas == 4, t
    d = law.decide(s, observe(20, 4, [0.1] * 4))
    assert (d.replicas, d.change) == (1, "down")


def test_idle_scales_to_zero_and_demand_brings_one_back() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=30, scale_down_delay_seconds=10)
    law = Autoscaler()
    idle = [hist({0.5: 3})]
    law.decide(s, observe(0, 1, [0.0], queue=idle))
    for t in range(5, 35, 5):
        d = law.decide(s, observe(t, 1, [0.0], queue=idle))
        assert d.replicas == 1, t
    d = law.decide(s, observe(35, 1, [0.0], queue=idle))
    assert (d.replicas, d.change) == (0, "to-zero")
    assert "no requests for 30s" in d.reason
    # At zero: nothing to read, nothing changes.
    d = law.decide(s, Observation(40, 0, 0, {}))
    assert (d.replicas, d.change) == (0, "none")
    # The router asks for capacity: one replica.
    d = law.decide(s, Observation(45, 0, 0, {}, demand_time=44))
    assert (d.replicas, d.change) == (1, "from-zero")
    # The router scaled it itself (Kubernetes): the replica is starting; the law holds it...
    for t in range(50, 200, 5):
        d = law.decide(s, Observation(t, 1, 0, {}, demand_time=44))
        assert d.replicas == 1, t
    # ...and once ready and idle, zero again only after the full idle time: the first read
    # of a replica shows no traffic yet (its counts span an unknown past), the second does.
    for t in (200, 205, 234):
        assert law.decide(s, observe(t, 1, [0.0], queue=idle)).replicas == 1
    assert law.decide(s, observe(235, 1, [0.0], queue=idle)).replicas == 0


def test_finished_requests_between_scrapes_are_traffic() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=20)
    law = Autoscaler()
    for t in range(0, 100, 5):
        # running and waiting read 0 at every scrape, but one request finished each time
        queue = [hist({0.5: t})]
        assert law.decide(s, observe(t, 1, [0.0], queue=queue)).replicas == 1


def test_recent_demand_holds_off_scale_to_zero() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=20)
    law = Autoscaler()
    idle = [hist({})]
    for t in range(0, 40, 5):
        d = law.decide(s, observe(t, 1, [0.0], queue=idle, demand=25))
    assert d.replicas == 1
    assert law.decide(s, observe(45, 1, [0.0], queue=idle, demand=25)).replicas == 0


def test_a_replica_without_the_queue_histogram_is_never_idle() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=10)
    law = Autoscaler()
    for t in range(0, 100, 5):
        assert law.decide(s, observe(t, 1, [0.0])).replicas == 1


def test_an_unread_replica_inside_the_delay_postpones_scale_down() -> None:
    s = spec(scale_down_delay_seconds=60)
    law = Autoscaler()
    for t in range(0, 95, 5):
        obs = observe(t, 4, [0.1] * 4)
        if t == 30:
            obs = Observation(t, 4, 4, {**obs.samples, "r3": None})
        assert law.decide(s, obs).replicas == 4, t
    assert law.decide(s, observe(95, 4, [0.1] * 4)).replicas == 1


def test_running_or_waiting_requests_are_never_idle() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=10)
    for running, waiting in ((1, 0), (0, 1)):
        law = Autoscaler()
        for t in range(0, 100, 5):
            obs = observe(t, 1, [0.0], running=running, waiting=waiting, queue=[hist({})])
            assert law.decide(s, obs).replicas == 1


def test_replicas_not_ready_yet_count_as_loaded_when_scaling_down() -> None:
    # 4 wanted, 2 ready and idle, 2 still starting: after the delay, 2 stay (not 1).
    s = spec(scale_down_delay_seconds=20)
    law = Autoscaler()
    decisions = [law.decide(s, observe(t, 4, [0.0, 0.0], ready=2)) for t in range(0, 25, 5)]
    assert [d.replicas for d in decisions] == [4, 4, 4, 4, 2]


def test_a_burst_is_sized_by_the_request_rate_over_what_a_full_replica_finishes() -> None:
    s = spec(max_replicas=20)
    law, fleet = Autoscaler(), Fleet()
    # Three full replicas (a request waiting on each) that keep up: 2 requests finish per
    # 5 s on each (0.4/s), as many arrive. The law learns a full replica finishes 0.4/s.
    for _ in range(20):
        d = fleet.step(law, s, 3, [(0.85, 20, 1, 2)] * 3)
        assert d.replicas == 3, d
    # Then requests come at 2.4/s: queues grow by 6 a step over the 6 finishing, while the
    # KV caches are as full as before (within the tolerance: no step yet)...
    waiting = 1.0
    for _ in range(3):
        waiting += 2
        assert fleet.step(law, s, 3, [(0.85, 20, waiting, 2)] * 3).replicas == 3
    # ...until they fill up. KV usage alone asks for 3 x 0.97 / 0.8 = 3.6 -> 4; the request
    # rate of the last 15 s over what a full replica finishes asks for 2.4 / (0.4 x 0.8) =
    # 7.5 -> 8, at once (panic: twice the ready replicas).
    d = fleet.step(law, s, 3, [(0.97, 20, waiting + 2, 2)] * 3)
    assert (d.replicas, d.change, d.panic) == (8, "up", True)
    assert d.load.need == pytest.approx(7.5)
    assert "a full replica finishes 0.40/s" in d.reason


def test_before_the_fleet_was_ever_full_a_burst_is_sized_by_how_fast_the_rate_rises() -> None:
    s = spec(max_replicas=20)
    law, fleet = Autoscaler(), Fleet()
    # 0.6/s, one request finishing per replica a step, nobody waiting.
    for _ in range(12):
        assert fleet.step(law, s, 3, [(0.5, 10, 0, 1)] * 3).replicas == 3
    # Then 2.4/s: each queue grows by 3 a step; the caches fill on the third step. Too few
    # requests finished while full to tell what a full replica finishes, so the rate of the
    # last 15 s against the 45 s before (4x) sizes the step: 3 x 4 = 12.
    waiting = 0.0
    for kv in (0.85, 0.85, 0.97):
        waiting += 3
        d = fleet.step(law, s, 3, [(kv, 10, waiting, 1)] * 3)
    assert (d.replicas, d.change, d.panic) == (12, "up", True)


def test_queue_times_of_a_backlog_do_not_panic_while_a_replica_has_room() -> None:
    law = Autoscaler()
    queue = [hist({})] * 2
    law.decide(spec(), observe(0, 2, [0.9, 0.9], queue=queue))
    # 20 requests finished after queueing 2..5 s (a backlog draining), but the second
    # replica has nobody waiting: new requests go there at once.
    slow = [hist({5.0: 10})] * 2
    obs = observe(5, 2, [0.9, 0.9], queue=slow)
    obs = Observation(
        5, 2, 2, {"r0": replace(obs.samples["r0"], waiting=20.0), "r1": obs.samples["r1"]}
    )
    d = law.decide(spec(), obs)
    assert d.load.queue_time_p90 is not None and d.load.queue_time_p90 > 2
    assert not d.panic
    assert d.replicas == 3  # KV usage alone: 1.8 / 0.8 = 2.25


def test_a_backlog_being_drained_adds_no_replica() -> None:
    def run(arriving: bool) -> Decision:
        law, fleet = Autoscaler(), Fleet()
        # A backlog of 20 on each of three replicas, each finishing 3 a step, their KV caches
        # in the band, as many requests arriving as finishing.
        for _ in range(6):
            assert fleet.step(law, spec(), 3, [(0.85, 20, 20, 3)] * 3).replicas == 3
        # The caches fill. Either requests keep coming as fast (the queues stay), or only 1 a
        # step comes per replica (the backlog drains by 2 a step).
        waiting = 20.0
        for _ in range(6):
            waiting = waiting if arriving else waiting - 2
            d = fleet.step(law, spec(), 3, [(0.99, 20, waiting, 3)] * 3)
            if d.change == "up":
                return d
        return d

    assert run(arriving=True).change == "up"
    assert run(arriving=False).change == "none"


def test_never_back_to_a_count_that_was_too_few_while_requests_come_as_fast() -> None:
    s = spec(scale_down_delay_seconds=30)
    law, fleet = Autoscaler(), Fleet()
    # One replica takes 0.6/s (3 requests finish a step, as many arrive)...
    for _ in range(12):
        assert fleet.step(law, s, 1, [(0.7, 20, 1, 3)]).replicas == 1
    # ...until its KV cache is fuller than the target allows.
    d = fleet.step(law, s, 1, [(0.95, 20, 1, 3)])
    assert (d.replicas, d.change) == (2, "up")
    # Two replicas take the same 0.6/s with room to spare: KV usage says one would do, but
    # one was too few at this rate.
    for _ in range(40):
        d = fleet.step(law, s, 2, [(0.3, 8, 0, 1.5)] * 2)
        assert d.replicas == 2, d
    assert d.load.need < 1
    # The rate halves: one is enough again.
    for _ in range(40):
        d = fleet.step(law, s, 2, [(0.1, 3, 0, 0.5)] * 2)
        if d.change == "down":
            break
    assert (d.replicas, d.change) == (1, "down")


def test_bounds() -> None:
    s = spec(min_replicas=2, max_replicas=5)
    assert Autoscaler().decide(s, observe(0, 1, [0.1])).replicas == 2
    assert Autoscaler().decide(s, observe(0, 9, [0.1] * 9)).replicas == 5
    assert Autoscaler().decide(s, observe(0, 5, [1.0] * 5)).replicas == 5
    assert Autoscaler().decide(s, Observation(0, 0, 0, {})).replicas == 2


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        LawSettings(max_scale_up_factor=1.0)
    with pytest.raises(ValueError):
        LawSettings(tolerance=-0.1)
