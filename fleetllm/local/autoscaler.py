"""The local fleet's autoscaler: each second, the ready replicas' `/metrics` (the shared
scraper) into the same control law the operator runs (`fleetllm.autoscale`), and
its decision applied by the supervisor. Only I/O and wiring live here; the law decides."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from fleetllm.api.scaling import ScalingSpec
from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.settings import LawSettings
from fleetllm.autoscale.step import Observation
from fleetllm.local.supervisor import Load, ModelFleet, Supervisor
from fleetllm.scrape import scrape_all

STEP_S = 1.0
SCRAPE_TIMEOUT_S = 2.0


def _scaling(fleet: ModelFleet) -> tuple[ScalingSpec, bool]:
    """The model's scaling spec, and whether decisions are applied. Without `spec.scaling`
    the law still measures the load for the status view, with its bounds pinned to the
    replicas there are, and its decisions are not applied."""
    spec = fleet.model.cr.spec.scaling
    if spec is not None:
        return spec, True
    pinned = max(1, fleet.desired)
    return ScalingSpec(min_replicas=pinned, max_replicas=pinned), False


async def run_autoscaler(
    supervisor: Supervisor,
    fleet: ModelFleet,
    session: aiohttp.ClientSession,
    settings: LawSettings | None = None,
) -> None:
    """Step the law for one model until cancelled."""
    law = Autoscaler(settings)
    while True:
        with contextlib.suppress(TimeoutError):
            # A demand signal from the router starts a step at once.
            await asyncio.wait_for(fleet.wake.wait(), STEP_S)
        fleet.wake.clear()
        if supervisor.stopping:
            return
        urls = fleet.ready_urls()
        samples = await scrape_all(session, urls, SCRAPE_TIMEOUT_S)
        spec, applied = _scaling(fleet)
        decision = law.decide(
            spec,
            Observation(
                time=time.monotonic(),
                replicas=fleet.desired,
                ready_replicas=len(urls),
                samples=samples,
                replica_capacity=fleet.model.plan.status.max_num_seqs,
                demand_time=fleet.demand_time,
            ),
        )
        load = decision.load
        waiting = load.waiting if load.sampled else None
        fleet.load = Load(load.kv_cache_usage, waiting, load.queue_time_p90)
        if applied and decision.replicas != fleet.desired:
            supervisor.set_desired(fleet.name, decision.replicas, decision.reason)
