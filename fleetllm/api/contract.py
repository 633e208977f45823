"""What the objects of one LLMDeployment are called and how they are found: labels, child
names, selectors, the engine's port. The operator renders these; the router's discovery, the
autoscaler and the local fleet find replicas by them."""

from __future__ import annotations

import base64
import hashlib
import hmac

from fleetllm.api.deployment import LLMDeployment

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_MODEL = "fleetllm.io/model"
ANNOTATION_APPLIED = "fleetllm.io/applied-hash"
MANAGER = "fleetllm"
COMPONENT = "engine"

ENGINE_PORT = 8000
"""The port every engine container listens on, whatever the backend."""
PORT_NAME = "http"
"""The name of that port on the container and on the Service (probes and discovery use it)."""

KV_EVENTS_PORT = 5557
"""Where an engine publishes its KV-cache events (vLLM's default port), for a model routed
`kv-aware`; the replay port serves the batches a subscriber missed."""
KV_REPLAY_PORT = 5558
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"
KV_EVENTS_TOPIC = "kv-events"


def kv_event_ports(cr: LLMDeployment) -> dict[str, int]:
    """Name -> port of the KV-event sockets an engine of `cr` opens: none unless the model
    is routed kv-aware (the events carry prompt tokens; only the router reads them)."""
    if cr.spec.routing.strategy != "kv-aware":
        return {}
    return {KV_EVENTS_PORT_NAME: KV_EVENTS_PORT, KV_REPLAY_PORT_NAME: KV_REPLAY_PORT}


def selector_labels(name: str) -> dict[str, str]:
    """The immutable subset of labels that selects one LLMDeployment's engine pods."""
    return {LABEL_NAME: "fleetllm", LABEL_INSTANCE: name, LABEL_COMPONENT: COMPONENT}


def selector_string(name: str) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


def child_labels(cr: LLMDeployment) -> dict[str, str]:
    return {
        **selector_labels(cr.metadata.name),
        LABEL_MANAGED_BY: MANAGER,
        LABEL_MODEL: cr.spec.model.name,
    }


def child_names(name: str) -> dict[str, str]:
    """Kind -> name of each child."""
    return {
        "ConfigMap": f"{name}-engine",
        "Service": name,
        "Deployment": f"{name}-engine",
        "PodDisruptionBudget": f"{name}-engine",
        "NetworkPolicy": f"{name}-engine",
        "Secret": engine_key_secret(name),
    }


ENGINE_KEY_FIELD = "api-key"
"""The data key, in the engine-key Secret, of the key every replica of one LLMDeployment
requires (Authorization: Bearer); the router sends it to that model's replicas only."""


def engine_key_secret(name: str) -> str:
    """The Secret, owned by the LLMDeployment, that holds its engines' API key."""
    return f"{name}-engine-key"


ENGINE_KEY_ROOT_ENV = "FLEETLLM_ENGINE_KEY_ROOT"
"""The fleet's root secret (the chart's `<release>-engine-keys` Secret), in the env of both the
operator and the router: each derives every engine key from it, so the router sends each model
its own key without reading any tenant's Secret."""


def engine_key(root: str | bytes, namespace: str, name: str, uid: str) -> str:
    """The key the engines of one LLMDeployment require: HMAC-SHA256 under the fleet's root of
    `namespace/name/uid` (urlsafe base64, 43 characters). The uid makes a deleted and recreated
    LLMDeployment of the same name a different key; a root rotation changes every key."""
    secret = root.encode() if isinstance(root, str) else root
    if not secret:
        raise ValueError("the engine key root is empty")
    digest = hmac.new(secret, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def endpoint(name: str, namespace: str) -> str:
    """In-cluster URL of the replicas (the headless Service resolves to the ready pods)."""
    return f"http://{name}.{namespace}.svc:{ENGINE_PORT}"
