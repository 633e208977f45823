"""What the router knows of one replica: its scraped load, its own in-flight count, and its
health, active (the scrape of /health) and passive (failed requests, with backoff)."""

from __future__ import annotations

import math

from fleetllm.router.strategies import Candidate

# vLLM's gauge names (and the pre-v1 name of the KV-cache gauge, which real vLLM pods of older
# versions still expose) -> the field they feed.
ENGINE_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The load gauges from a Prometheus text exposition, summed over label sets (a replica
    that serves several model names reports one series per name)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            # Label values may hold spaces; the sample follows the closing brace.
            rest = line[line.rfind("}") + 1 :].split()
        else:
            name, _, tail = line.partition(" ")
            rest = tail.split()
        field = ENGINE_GAUGES.get(name)
        if field is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if not math.isnan(value):  # NaN says nothing about load
            found[field] = found.get(field, 0.0) + value
    return found


class Replica:
    """One replica of one model, addressed by its base URL (also its id on the hash ring)."""

    __slots__ = (
        "down_until",
        "draining",
        "failures",
        "healthy",
        "in_flight",
        "kv_usage",
        "model",
        "running",
        "url",
        "waiting",
    )

    def __init__(self, url: str, model: str, draining: bool = False) -> None:
        self.url = url
        self.model = model
        self.draining = draining
        self.in_flight = 0
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        # None until the first scrape: a newly registered replica is tried at once.
        self.healthy: bool | None = None
        self.failures = 0
        self.down_until = 0.0

    def available(self, now: float) -> bool:
        return not self.draining and self.healthy is not False and now >= self.down_until

    def candidate(self) -> Candidate:
        return Candidate(self.url, self.in_flight, self.waiting, self.kv_usage)

    def record_failure(self, now: float, base: float, cap: float) -> None:
        """A connection error or 5xx: no new requests until the backoff passes; it doubles
        with each failure in a row."""
        self.failures += 1
        self.down_until = now + min(cap, base * 2 ** min(self.failures - 1, 30))

    def record_success(self) -> None:
        self.failures = 0

    def record_scrape(self, healthy: bool, gauges: dict[str, float] | None) -> None:
        if healthy and self.healthy is False:
            # It came back (restarted, finished loading): start from a clean slate.
            self.failures = 0
            self.down_until = 0.0
        self.healthy = healthy
        if gauges:
            self.running = gauges.get("running", self.running)
            self.waiting = gauges.get("waiting", self.waiting)
            self.kv_usage = gauges.get("kv_usage", self.kv_usage)
