"""The router's settings (the flags of `fleetllm router serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from fleetllm.api.deployment import RoutingSpec
from fleetllm.httpread import MiB
from fleetllm.scrape import MAX_METRICS_BYTES

# The CRD's strategy names are the router's.
STRATEGIES: tuple[str, ...] = get_args(RoutingSpec.model_fields["strategy"].annotation)
_ROUTING_DEFAULTS = RoutingSpec()


@dataclass(frozen=True)
class RouterSettings:
    host: str = "0.0.0.0"
    port: int = 8080

    # Routing defaults for models whose discovery source gives none (the static file).
    strategy: str = _ROUTING_DEFAULTS.strategy
    load_factor: float = _ROUTING_DEFAULTS.load_factor
    session_header: str = _ROUTING_DEFAULTS.session_header
    prefix_chars: int = 256
    """How much of the rendered prompt keys the prefix strategy: enough to cover a typical
    system prompt, so that requests which share one share a replica."""

    # kv-aware: what the router keeps of each replica's KV cache, and how.
    kv_index_max_blocks: int = 1 << 18
    """Block keys kept per replica (past it, the oldest are forgotten)."""
    kv_max_prompt_tokens: int = 1 << 15
    """Only this many leading prompt tokens are tokenized and looked up."""
    kv_events_probe_interval: float = 1.0
    """How often each replica's event stream is checked against its replay buffer."""
    kv_events_stale_after: float = 5.0
    """A replica whose check has not answered for this long is routed as if unknown."""
    tokenizers: tuple[tuple[str, str], ...] = ()
    """(model, directory) of tokenizers for models whose discovery names none."""

    # Upstream timeouts (seconds) and retries.
    connect_timeout: float = 5.0
    first_byte_timeout: float = 120.0
    """Until the replica's first response byte (for a stream, its first event)."""
    request_timeout: float = 900.0
    """The whole request, holding and retries included."""
    max_attempts: int = 3
    retry_window: float = 30.0
    """No new attempt starts later than this after the request arrived."""
    backoff_base: float = 0.5
    backoff_max: float = 10.0

    # Holding while a model has no ready replica.
    hold_queue_size: int = 256
    hold_queue_bytes: int = 64 * 1024 * 1024
    """The request bodies held per model, together (each is kept in memory while it waits)."""
    hold_timeout: float = 60.0
    demand_interval: float = 5.0
    """Least time between two demand signals for one model."""

    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0

    max_body_bytes: int = 16 * 1024 * 1024
    client_header_timeout: float = 60.0
    """A client connection must deliver a request's headers within this many seconds of
    opening or of its previous answer (also how long an idle keep-alive connection stays)."""
    client_body_timeout: float = 60.0
    """The whole request body must arrive within this many seconds of its headers."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent as a bearer token to the replicas discovery names no LLMDeployment for (the static
    fleet file's; engines started with --api-key)."""
    engine_key_root: bytes = field(default=b"", repr=False)
    """The fleet's root: each LLMDeployment's replicas get their own key derived from it
    (`contract.engine_key`); empty: they get `upstream_api_key` like the others."""

    # What one replica may make the router hold (over a cap: the replica is backed off and
    # the client gets 502).
    max_metrics_bytes: int = MAX_METRICS_BYTES
    max_answer_bytes: int = 64 * MiB
    """A non-streamed answer, read whole before it is relayed."""
    max_event_bytes: int = 1 * MiB
    """One server-sent event of a stream (events are relayed whole)."""

    # What all clients together may make the router hold (over a cap: 503 + Retry-After).
    max_inflight_requests: int = 4096
    max_inflight_bytes: int = 128 * MiB
    """Request bodies being read, held or relayed, together. A body costs the router about
    four times its size while it is held (as read, as parsed, as re-encoded for the replica):
    the default keeps a flood of the largest bodies within the chart's 1 GiB."""

    cache_salt_secret: bytes = b""
    """The HMAC key of the per-tenant `cache_salt`; empty: a random one per process."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; one of {', '.join(STRATEGIES)}")
        checks = {
            "load factor": self.load_factor >= 1,
            "prefix chars": self.prefix_chars >= 1,
            "kv index max blocks": self.kv_index_max_blocks >= 1,
            "kv max prompt tokens": self.kv_max_prompt_tokens >= 1,
            "kv events probe interval": self.kv_events_probe_interval > 0,
            "kv events stale after": self.kv_events_stale_after > self.kv_events_probe_interval,
            "connect timeout": self.connect_timeout > 0,
            "first byte timeout": self.first_byte_timeout > 0,
            "request timeout": self.request_timeout > 0,
            "max attempts": self.max_attempts >= 1,
            "retry window": self.retry_window >= 0,
            "hold queue size": self.hold_queue_size >= 0,
            "hold queue bytes": self.hold_queue_bytes >= 0,
            "hold timeout": self.hold_timeout >= 0,
            "scrape interval": self.scrape_interval > 0,
            "max body bytes": self.max_body_bytes >= 1024,
            "client header timeout": self.client_header_timeout > 0,
            "client body timeout": self.client_body_timeout > 0,
            "backoff": 0 < self.backoff_base <= self.backoff_max,
            "max metrics bytes": self.max_metrics_bytes >= 1024,
            "max answer bytes": self.max_answer_bytes >= 1024,
            "max event bytes": self.max_event_bytes >= 1024,
            "max inflight requests": self.max_inflight_requests >= 1,
            "max inflight bytes": self.max_inflight_bytes >= self.max_body_bytes,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid router settings: {', '.join(bad)} out of range")
