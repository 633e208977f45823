"""The control plane's own objects: the operator, the router (the fleet's one OpenAI endpoint)
and their least-privilege RBAC, plus optional Prometheus Operator monitors. Pure, no I/O.

`fleetllm manifests` prints them; manifests/base and manifests/monitoring hold that output (a
test keeps them current), and the Helm chart is checked against the same builders. Every image
comes from images.py, so the version constant tags them all.
"""

from __future__ import annotations

from typing import Any

from fleetllm.operator.api import GROUP, PLURAL
from fleetllm.operator.config import DEFAULT_CONFIG, OperatorConfig
from fleetllm.operator.images import CONTROL_PLANE_IMAGE
from fleetllm.operator.reconciler import AUTOSCALER_RESOURCES, CHILD_RESOURCES, READ_RESOURCES
from fleetllm.operator.render import COMPONENT, LABEL_COMPONENT, LABEL_NAME, RUN_AS

NAMESPACE = "fleetllm-system"
OPERATOR = "fleetllm-operator"
ROUTER = "fleetllm-router"
ROUTER_KEYS_SECRET = "fleetllm-router-keys"
ROUTER_PORT = 8080
ROUTER_REPLICAS = 2
ROUTER_SHUTDOWN_SECONDS = 60
OPERATOR_HEALTH_PORT = 8080
PEERING = "fleetllm"
METRICS_INTERVAL = "15s"


def _labels(component: str) -> dict[str, str]:
    return {LABEL_NAME: "fleetllm", LABEL_COMPONENT: component}


def _meta(name: str, component: str, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = _labels(component)
    return meta


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def _binding(
    kind: str, name: str, component: str, namespace: str | None, account_ns: str
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": f"{kind}Binding",
        "metadata": _meta(name, component, namespace),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": account_ns}],
    }


def _service_account(name: str, component: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(name, component, namespace),
    }


_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _spread(component: str) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": _labels(component)},
        }
    ]


def namespace_object(namespace: str = NAMESPACE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace,
            # The control plane's pods meet the restricted Pod Security Standard.
            "labels": {LABEL_NAME: "fleetllm", "pod-security.kubernetes.io/enforce": "restricted"},
        },
    }


# -- the operator ---------------------------------------------------------------------------


def operator_rules() -> list[dict[str, Any]]:
    """What the reconciler, the autoscaler and kopf touch: the children (written by
    server-side apply), the HPA or ScaledObject of spec.scaling.mode, the model claims it
    reads, status and scale, the engine pods (read and scraped; annotated with a deletion cost
    before a scale-down), events and the peering objects."""
    rules = [
        _rule(GROUP, [PLURAL], ["get", "list", "watch", "patch", "update"]),
        _rule(GROUP, [f"{PLURAL}/status", f"{PLURAL}/scale"], ["get", "patch", "update"]),
        _rule("", ["pods"], ["get", "list", "patch"]),
    ]
    by_group: dict[str, list[str]] = {}
    for resource in CHILD_RESOURCES.values():
        group = resource.api_version.rpartition("/")[0]
        by_group.setdefault(group, []).append(resource.plural)
    for group, plurals in by_group.items():
        verbs = ["get", "list", "watch", "create", "patch", "update", "delete"]
        rules.append(_rule(group, sorted(plurals), verbs))
    for resource in AUTOSCALER_RESOURCES.values():
        rules.append(
            _rule(
                resource.api_version.rpartition("/")[0],
                [resource.plural],
                ["get", "create", "patch", "delete"],
            )
        )
    for resource in READ_RESOURCES.values():
        rules.append(_rule(resource.api_version.rpartition("/")[0], [resource.plural], ["get"]))
    rules += [
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        _rule(
            "kopf.dev", ["clusterkopfpeerings", "kopfpeerings"], ["get", "list", "watch", "patch"]
        ),
        _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["get", "list", "watch"]),
        _rule("", ["namespaces"], ["get", "list", "watch"]),
    ]
    return rules


def config_args(config: OperatorConfig) -> list[str]:
    """`fleetllm operator run` flags that carry `config` (none for the defaults)."""
    args = []
    if config.gpu_profile != DEFAULT_CONFIG.gpu_profile:
        args.append(f"--gpu-profile={config.gpu_profile}")
    if config.model_cache is not None:
        args.append(f"--model-cache-claim={config.model_cache.claim_name}")
        if config.model_cache.read_only:
            args.append("--model-cache-read-only")
    return args


def operator_objects(
    namespace: str = NAMESPACE,
    config: OperatorConfig = DEFAULT_CONFIG,
    image: str = CONTROL_PLANE_IMAGE,
) -> list[dict[str, Any]]:
    component = "operator"
    # Two replicas for availability; peering lets only the highest-priority live one act.
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(OPERATOR, component, namespace),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": _labels(component)},
            "template": {
                "metadata": {"labels": _labels(component)},
                "spec": {
                    "serviceAccountName": OPERATOR,
                    "securityContext": dict(_POD_SECURITY),
                    "containers": [
                        {
                            "name": "operator",
                            "image": image,
                            "command": ["fleetllm", "operator", "run"],
                            "args": [
                                "--all-namespaces",
                                f"--peering={PEERING}",
                                f"--liveness=http://0.0.0.0:{OPERATOR_HEALTH_PORT}/healthz",
                                *config_args(config),
                            ],
                            "ports": [
                                {
                                    "name": "health",
                                    "containerPort": OPERATOR_HEALTH_PORT,
                                    "protocol": "TCP",
                                }
                            ],
                            "livenessProbe": {
                                "httpGet": {"path": "/healthz", "port": "health"},
                                "periodSeconds": 20,
                                "failureThreshold": 3,
                            },
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "256Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": _container_security(),
                        }
                    ],
                    "topologySpreadConstraints": _spread(component),
                },
            },
        },
    }
    return [
        _service_account(OPERATOR, component, namespace),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": _meta(OPERATOR, component, None),
            "rules": operator_rules(),
        },
        _binding("ClusterRole", OPERATOR, component, None, namespace),
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": PEERING, "labels": _labels(component)},
        },
        deployment,
    ]


# -- the router -----------------------------------------------------------------------------


def router_cluster_rules() -> list[dict[str, Any]]:
    """Kubernetes discovery: LLMDeployments (routing, replicas), the Services the operator
    rendered for them (to check who controls them) and their EndpointSlices, in every
    namespace; scale-from-zero through the scale subresource."""
    return [
        _rule(GROUP, [PLURAL], ["get", "list", "watch"]),
        _rule(GROUP, [f"{PLURAL}/scale"], ["get", "patch"]),
        _rule("", ["services"], ["get", "list", "watch"]),
        _rule("discovery.k8s.io", ["endpointslices"], ["get", "list", "watch"]),
    ]


def router_args(namespace: str = NAMESPACE) -> list[str]:
    return [
        "--discovery=kubernetes",
        "--all-namespaces",
        f"--api-keys-secret={namespace}/{ROUTER_KEYS_SECRET}",
        f"--port={ROUTER_PORT}",
        f"--shutdown-timeout={ROUTER_SHUTDOWN_SECONDS}",
    ]


def router_objects(
    namespace: str = NAMESPACE, image: str = CONTROL_PLANE_IMAGE, replicas: int = ROUTER_REPLICAS
) -> list[dict[str, Any]]:
    component = "router"
    labels = _labels(component)
    http_probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    container = {
        "name": "router",
        "image": image,
        "command": ["fleetllm", "router", "serve"],
        "args": router_args(namespace),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # /health is 503 until discovery has reported the fleet and while stopping.
        "readinessProbe": {**http_probe, "failureThreshold": 2},
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        # Endpoint removal reaches load balancers and kube-proxy before the router stops
        # taking requests; it then lets running ones finish.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": _container_security(),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ROUTER, component, namespace),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": ROUTER,
                    "securityContext": dict(_POD_SECURITY),
                    "terminationGracePeriodSeconds": ROUTER_SHUTDOWN_SECONDS + 15,
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
                    "topologySpreadConstraints": _spread(component),
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ROUTER, component, namespace),
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [
                {
                    "name": "http",
                    "port": 80,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ROUTER, component, namespace),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}},
    }
    # The keys Secret only, by name, in the router's own namespace.
    keys_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(ROUTER, component, namespace),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [ROUTER_KEYS_SECRET],
                "verbs": ["get"],
            }
        ],
    }
    return [
        _service_account(ROUTER, component, namespace),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": _meta(ROUTER, component, None),
            "rules": router_cluster_rules(),
        },
        _binding("ClusterRole", ROUTER, component, None, namespace),
        keys_role,
        _binding("Role", ROUTER, component, namespace, namespace),
        deployment,
        service,
        pdb,
    ]


def base_objects(
    namespace: str = NAMESPACE, config: OperatorConfig = DEFAULT_CONFIG
) -> list[dict[str, Any]]:
    """Everything but the CRDs: namespace, operator, router (manifests/base)."""
    return [
        namespace_object(namespace),
        *operator_objects(namespace, config),
        *router_objects(namespace),
    ]


# -- monitoring (Prometheus Operator) ------------------------------------------------------


def monitoring_objects(namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """A PodMonitor for every engine pod (any namespace; vLLM's metric names) and a
    ServiceMonitor for the router (manifests/monitoring; needs the monitoring.coreos.com CRDs)."""
    endpoint = {"port": "http", "path": "/metrics", "interval": METRICS_INTERVAL}
    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": _meta("fleetllm-engines", COMPONENT, namespace),
            "spec": {
                "namespaceSelector": {"any": True},
                "selector": {"matchLabels": _labels(COMPONENT)},
                "podMetricsEndpoints": [dict(endpoint)],
            },
        },
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": _meta(ROUTER, "router", namespace),
            "spec": {
                "selector": {"matchLabels": _labels("router")},
                "endpoints": [dict(endpoint)],
            },
        },
    ]
