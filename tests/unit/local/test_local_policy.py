"""The supervisor's pure decisions: restart backoff and which replicas a scale-down stops."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleetllm.local.policy import (
    RESTART_CAP_S,
    STABLE_AFTER_S,
    Candidate,
    State,
    failures_after_exit,
    restart_delay,
    to_retire,
)


def test_restart_delay_doubles_from_one_second_up_to_the_cap() -> None:
    assert [restart_delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert restart_delay(0) == 0
    assert restart_delay(10**6) == RESTART_CAP_S


def test_a_replica_that_served_long_enough_starts_its_backoff_afresh() -> None:
    assert failures_after_exit(5, STABLE_AFTER_S) == 1
    assert failures_after_exit(5, STABLE_AFTER_S - 1) == 6
    # One that never became ready keeps climbing: a crash loop slows down.
    assert failures_after_exit(5, None) == 6


def test_scale_down_stops_idle_ready_replicas_before_busy_ones_and_unready_first() -> None:
    replicas = [
        Candidate(0, State.READY, in_flight=3),
        Candidate(1, State.READY, in_flight=0),
        Candidate(2, State.STARTING, in_flight=0),
        Candidate(3, State.BACKOFF, in_flight=0),
    ]
    assert to_retire(replicas, 3) == [3]
    assert to_retire(replicas, 2) == [3, 2]
    assert to_retire(replicas, 1) == [3, 2, 1]
    assert to_retire(replicas, 0) == [3, 2, 1, 0]
    assert to_retire(replicas, 4) == []
    # Among equals the newest goes.
    assert to_retire([Candidate(0, State.READY, 0), Candidate(1, State.READY, 0)], 1) == [1]


def test_replicas_already_leaving_do_not_count() -> None:
    replicas = [
        Candidate(0, State.READY, 0),
        Candidate(1, State.DRAINING, 0),
        Candidate(2, State.STOPPING, 0),
    ]
    assert to_retire(replicas, 1) == []
    assert to_retire(replicas, 0) == [0]


states = st.sampled_from(list(State))


@given(
    st.lists(st.tuples(states, st.integers(0, 50)), max_size=12),
    st.integers(0, 14),
)
def test_retiring_leaves_exactly_the_desired_active_replicas(
    replicas: list[tuple[State, int]], desired: int
) -> None:
    candidates = [Candidate(i, s, n) for i, (s, n) in enumerate(replicas)]
    leaving = {State.DRAINING, State.STOPPING}
    active = [c for c in candidates if c.state not in leaving]
    chosen = to_retire(candidates, desired)
    assert len(chosen) == len(set(chosen)) == max(0, len(active) - desired)
    assert all(candidates[key].state not in leaving for key in chosen)
    # No ready replica goes while one that serves nothing stays.
    kept = [c for c in active if c.key not in chosen]
    if any(candidates[key].state is State.READY for key in chosen):
        assert all(c.state is State.READY for c in kept)
