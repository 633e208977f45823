"""What the router knows of one replica: its scraped load, its own in-flight count, and its
health, active (the scrape of /health) and passive (failed requests, with backoff)."""

from __future__ import annotations

from fleetllm.router.strategies import Candidate
from fleetllm.scrape import EngineSample


class Replica:
    """One replica of one model, addressed by its base URL (also its id on the hash ring)."""

    __slots__ = (
        "adapters",
        "down_until",
        "draining",
        "engine",
        "failures",
        "healthy",
        "in_flight",
        "kv_usage",
        "max_model_len",
        "model",
        "running",
        "url",
        "waiting",
    )

    def __init__(
        self,
        url: str,
        model: str,
        draining: bool = False,
        engine: tuple[str, str, str] | None = None,
    ) -> None:
        self.url = url
        self.model = model
        self.draining = draining
        self.engine = engine
        """(namespace, name, uid) of its LLMDeployment, which names its key; None: static."""
        self.in_flight = 0
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        # None until the first scrape: a newly registered replica is tried at once.
        self.healthy: bool | None = None
        self.failures = 0
        self.down_until = 0.0
        self.max_model_len: int | None = None
        """Its context length, from its model card; None until read (again after it was
        down: it may have come back with other settings)."""
        self.adapters: frozenset[str] = frozenset()
        """The LoRA adapters it holds, as its /v1/models last listed them (and as loaded since)."""

    def available(self, now: float) -> bool:
        return not self.draining and self.healthy is not False and now >= self.down_until

    def candidate(self) -> Candidate:
        return Candidate(self.url, self.in_flight, self.waiting, self.kv_usage)

    def record_failure(self, now: float, base: float, cap: float) -> None:
        """The replica could not serve (see `outcomes`): no new requests until the backoff
        passes; it doubles with each failure in a row."""
        self.failures += 1
        self.down_until = now + min(cap, base * 2 ** min(self.failures - 1, 30))

    def record_success(self) -> None:
        self.failures = 0

    def record_scrape(self, healthy: bool, sample: EngineSample | None) -> None:
        if healthy and self.healthy is False:
            # It came back (restarted, finished loading): start from a clean slate.
            self.failures = 0
            self.down_until = 0.0
        if not healthy:
            self.max_model_len = None
        self.healthy = healthy
        if sample is not None:
            # A gauge the replica did not report keeps its last value.
            if sample.running is not None:
                self.running = sample.running
            if sample.waiting is not None:
                self.waiting = sample.waiting
            if sample.kv_cache_usage is not None:
                self.kv_usage = sample.kv_cache_usage
