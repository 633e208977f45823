"""kopf's wiring of the control loop: every LLMDeployment is resynced on a timer that puts no
finalizer on it, handlers and kopf's own API requests retry without limit, and each wait is
capped."""

from __future__ import annotations

import itertools
from collections.abc import Sized

from fleetllm.operator.handlers import MAX_BACKOFF_SECONDS, build_registry, make_settings
from fleetllm.operator.retry import Backoff


def test_the_resync_timer_covers_every_llmdeployment_without_a_finalizer() -> None:
    registry = build_registry(autoscale_interval=5.0, resync_interval=42.0)
    timers = {h.id: h for h in registry._spawning.get_all_handlers()}
    resync = timers["resync"]
    assert resync.interval == 42.0 and resync.initial_delay == 42.0
    assert resync.when is None  # every LLMDeployment, whatever its spec
    assert resync.requires_finalizer is False
    # The autoscaler's timer keeps its finalizer, on the LLMDeployments it steps only.
    assert timers["autoscale"].requires_finalizer is True and timers["autoscale"].when is not None
    changing = registry._changing.get_all_handlers()
    assert changing and all(h.retries is None for h in changing)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(first_seconds=1.0, max_seconds=60.0)
    assert [backoff.delay(a) for a in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff.delay(10_000) == 60.0


def test_kopfs_own_requests_retry_without_limit_each_wait_capped() -> None:
    # kopf's default gives up after eight tries, and a watch that gives up stops the operator.
    backoffs = make_settings(standalone=True).networking.error_backoffs
    assert not isinstance(backoffs, Sized)  # kopf reads a length as a number of tries
    waits = list(itertools.islice(backoffs, 1000))
    assert waits[:3] == [1, 2, 4] and max(waits) == waits[-1] == MAX_BACKOFF_SECONDS
    assert list(itertools.islice(backoffs, 3)) == [1, 2, 4]  # every request starts afresh
