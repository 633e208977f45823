"""What clients may make each router replica hold: the chart passes a default cap per API key
and the caps for all keys together, equal to the router's own defaults, sized to the router's
memory limit, and an admin's values reach the flags."""

from __future__ import annotations

from typing import Any

from helmchart import one, render

from fleetllm.api.quantity import parse_quantity
from fleetllm.cli import build_parser
from fleetllm.router.cli import settings_from_args
from fleetllm.router.config import RouterSettings

# A body held costs the router about this many times its size (tests/integration/router/
# test_router_hostile.py measures it).
BODY_COST = 4


def _router(objects: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    (container,) = one(objects, "Deployment", "fleetllm-router")["spec"]["template"]["spec"][
        "containers"
    ]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    return args, container


def test_the_chart_caps_each_key_and_all_together_within_the_routers_memory() -> None:
    args, container = _router(render())
    settings = settings_from_args(args)
    defaults = RouterSettings()
    assert args.max_concurrent_per_key == 64
    assert settings.max_inflight_requests == defaults.max_inflight_requests
    assert settings.max_inflight_bytes == defaults.max_inflight_bytes
    limit = parse_quantity(container["resources"]["limits"]["memory"])
    assert BODY_COST * settings.max_inflight_bytes < limit


def test_an_admins_limits_reach_the_router() -> None:
    sets = [
        "router.limits.maxConcurrentPerKey=8",
        "router.limits.maxInflightRequests=100",
        "router.limits.maxInflightBytes=67108864",
    ]
    args, _ = _router(render(None, *sets))
    settings = settings_from_args(args)
    assert args.max_concurrent_per_key == 8
    assert (settings.max_inflight_requests, settings.max_inflight_bytes) == (100, 64 << 20)
