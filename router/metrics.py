"""The router's Prometheus metrics (`fleetllm:router_*`), in a registry of its own so that
several routers can live in one process (tests, the local fleet)."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# fmt: off
# vLLM's request-latency buckets, so that router and engine figures line up on one dashboard.
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FIRST_BYTE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                 600.0)
# fmt: on

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fleetllm:router_requests",
            "Requests answered by the router, by HTTP status.",
            ["model", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "fleetllm:router_request_duration_seconds",
            "Arrival to the last byte sent to the client.",
            ["model"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "fleetllm:router_time_to_first_byte_seconds",
            "Arrival to the first response byte sent to the client (for a stream, its first "
            "event with a token, which goes out with the events held back before it).",
            ["model"],
            buckets=FIRST_BYTE_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "fleetllm:router_queue_time_seconds",
            "Time requests were held waiting for a ready replica.",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "fleetllm:router_upstream_retries",
            "Attempts on another replica after a failed one.",
            ["model"],
            registry=r,
        )
        self.upstream = Counter(
            "fleetllm:router_upstream_requests",
            "Attempts sent to each replica, by outcome (HTTP status, or `error` when no "
            "complete answer came).",
            ["model", "replica", "code"],
            registry=r,
        )
        self.inflight = Gauge(
            "fleetllm:router_inflight",
            "Requests open on each replica.",
            ["model", "replica"],
            registry=r,
        )
        self.replica_up = Gauge(
            "fleetllm:router_replica_up",
            "1 when a replica takes new requests (healthy, not draining, not backing off).",
            ["model", "replica"],
            registry=r,
        )
        self.held = Gauge(
            "fleetllm:router_held_requests",
            "Requests held now, waiting for a replica.",
            ["model"],
            registry=r,
        )
        self.demand = Counter(
            "fleetllm:router_demand_signals",
            "Requests for capacity sent for models that had no ready replica.",
            ["model"],
            registry=r,
        )
        # From the LLMDeployment (Kubernetes discovery): with replica_up, the dashboard's
        # desired/ready replicas and the alert on a model held at its maximum.
        self.desired_replicas = Gauge(
            "fleetllm:router_model_desired_replicas",
            "Replicas the model's LLMDeployment asks for (spec.replicas).",
            ["model"],
            registry=r,
        )
        self.max_replicas = Gauge(
            "fleetllm:router_model_max_replicas",
            "The autoscaler's bound on the model's replicas (spec.scaling.maxReplicas).",
            ["model"],
            registry=r,
        )
        # kv-aware: how well the router knows what the replicas cache.
        self.kv_resyncs = Counter(
            "fleetllm:router_kv_events_resyncs",
            "Times the router's view of a replica's KV cache lost history and was rebuilt "
            "(a gap no replay filled, a restarted publisher, a malformed batch).",
            ["model", "replica", "reason"],
            registry=r,
        )
        self.kv_predictions = Counter(
            "fleetllm:router_kv_predictions",
            "kv-aware requests whose answer reported cached tokens, by how the prediction "
            "compared: exact, over (predicted more) or under.",
            ["model", "outcome"],
            registry=r,
        )
        self.kv_predicted_tokens = Counter(
            "fleetllm:router_kv_predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen replica had cached, over the "
            "requests counted in fleetllm:router_kv_predictions.",
            ["model"],
            registry=r,
        )
        self.kv_reported_tokens = Counter(
            "fleetllm:router_kv_reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens the replicas reported, over the same "
            "requests.",
            ["model"],
            registry=r,
        )

        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, memoized: the proxy path looks up several per request."""
        key = (metric._name, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def forget_replica(self, model: str, replica: str) -> None:
        """Drop a replica's series, so that churn (new pod addresses) does not grow them."""
        for metric in (self.inflight, self.replica_up, self.upstream, self.kv_resyncs):
            for key in [k for k in self._children if k[0] == metric._name]:
                labels = key[1]
                if labels[:2] == (model, replica):
                    del self._children[key]
                    with contextlib.suppress(KeyError):
                        metric.remove(*labels)

    def set_model_replicas(self, model: str, desired: int | None, maximum: int | None) -> None:
        """Publish a model's desired and maximum replicas; an unknown value has no series."""
        for metric, value in ((self.desired_replicas, desired), (self.max_replicas, maximum)):
            if value is None:
                with contextlib.suppress(KeyError):
                    metric.remove(model)
            else:
                metric.labels(model).set(value)

    def forget_model(self, model: str) -> None:
        self.set_model_replicas(model, None, None)

    def record_prediction(self, model: str, predicted: int, reported: int) -> None:
        outcome = "exact" if predicted == reported else "over" if predicted > reported else "under"
        self.child(self.kv_predictions, model, outcome).inc()
        self.child(self.kv_predicted_tokens, model).inc(predicted)
        self.child(self.kv_reported_tokens, model).inc(reported)

    def render(self) -> bytes:
        return generate_latest(self.registry)
