"""The hypothesis settings of the HTTP fuzz tests (the engine's and the router's schemas)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz_settings(max_examples: int) -> settings:
    """The same cases on every run (derandomized, with no example database), and neither a
    deadline nor health checks: each case is a real HTTP request."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        max_examples=max_examples,
    )
