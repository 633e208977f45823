"""Who may reach one LLMDeployment's engines: its NetworkPolicy (ingress from the fleet's
router and operator pods only, egress anywhere but cloud metadata) and the key its engines
require (a Secret it owns, read by the engine through its env). Pure, no I/O."""

from __future__ import annotations

import base64
from typing import Any

from fleetllm.api.contract import (
    ENGINE_KEY_FIELD,
    PORT_NAME,
    child_names,
    engine_key_secret,
    kv_event_ports,
    selector_labels,
)
from fleetllm.api.deployment import LLMDeployment
from fleetllm.planner.settings import OperatorConfig

# Instance metadata of every major cloud (node credentials, IRSA tokens); IPv4 and AWS's IPv6.
METADATA_CIDRS = {"0.0.0.0/0": "169.254.169.254/32", "::/0": "fd00:ec2::254/128"}
# The variable each backend reads its required key from (vLLM's --api-key reads VLLM_API_KEY;
# the builtin engine's --api-key reads FLEETLLM_API_KEY): an env var keeps the key out of the
# pod's args and the engine ConfigMap.
KEY_ENV = {"builtin": "FLEETLLM_API_KEY", "vllm": "VLLM_API_KEY"}


def _fleet_peer(config: OperatorConfig, component: str) -> dict[str, Any]:
    # Both selectors in one peer: only these pods, and only in the fleet's own namespace,
    # where a tenant cannot make pods that carry these labels.
    return {
        "namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": config.fleet_namespace}
        },
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "fleetllm",
                "app.kubernetes.io/instance": config.fleet_instance,
                "app.kubernetes.io/component": component,
            }
        },
    }


def render_networkpolicy(
    cr: LLMDeployment, config: OperatorConfig, metadata: dict[str, Any]
) -> dict[str, Any]:
    router = _fleet_peer(config, "router")
    peers = [router, _fleet_peer(config, "operator")]
    peers += [dict(peer) for peer in config.policy.engine_ingress_from]
    ingress = [{"from": peers, "ports": [{"port": PORT_NAME, "protocol": "TCP"}]}]
    if events := kv_event_ports(cr):
        # Prompt tokens travel in the events: the router alone reads them.
        ports = [{"port": name, "protocol": "TCP"} for name in events]
        ingress.append({"from": [dict(router)], "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": selector_labels(cr.metadata.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [
                {"to": [{"ipBlock": {"cidr": cidr, "except": [metadata_ip]}}]}
                for cidr, metadata_ip in METADATA_CIDRS.items()
            ],
        },
    }


def networkpolicy_name(cr: LLMDeployment) -> str:
    return child_names(cr.metadata.name)["NetworkPolicy"]


def key_env(cr: LLMDeployment) -> dict[str, Any]:
    """The engine container's variable that holds the required key."""
    return {
        "name": KEY_ENV[cr.spec.engine.backend],
        "valueFrom": {
            "secretKeyRef": {"name": engine_key_secret(cr.metadata.name), "key": ENGINE_KEY_FIELD}
        },
    }


def render_key_secret(metadata: dict[str, Any], key: str) -> dict[str, Any]:
    """The engine-key Secret. As `data`, the form the API server returns, so that comparing it
    with the live Secret tells whether a derived key changed (see docs/security.md, rotation)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {ENGINE_KEY_FIELD: base64.b64encode(key.encode()).decode()},
    }
