"""The router's discovery for the local fleet: the supervisor publishes the ready replicas to
the router in-process, and the router's demand signal (a request for a model at zero
replicas) goes back to the supervisor."""

from __future__ import annotations

from collections.abc import Callable

from fleetllm.router.discovery import Fleet, ModelRoute, Publish


class LocalDiscovery:
    """The router's discovery for the local fleet: the supervisor publishes, in-process."""

    def __init__(self, on_demand: Callable[[str], None]) -> None:
        self.on_demand = on_demand
        self._publish: Publish | None = None
        self._fleet: Fleet = {}

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        publish(self._fleet)

    def update(self, fleet: Fleet) -> None:
        self._fleet = fleet
        if self._publish is not None:
            self._publish(fleet)

    async def signal_demand(self, route: ModelRoute) -> None:
        self.on_demand(route.name)
