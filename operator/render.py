"""Plan -> the Kubernetes objects of one LLMDeployment, built as plain dicts. Pure, no I/O.

Every child carries the same labels and, when the owner's uid is known, an ownerReference, so
that deleting the LLMDeployment garbage-collects them. Values are rendered in the canonical
form the API server stores (quantities as strings, no empty maps), so that comparing a live
object with its rendering shows no spurious difference.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from fleetllm.api.catalog import GIB, GPU_RESOURCE
from fleetllm.api.contract import (
    ANNOTATION_APPLIED,
    ENGINE_PORT,
    PORT_NAME,
    child_labels,
    child_names,
    kv_event_ports,
    selector_labels,
)
from fleetllm.api.deployment import API_VERSION, KIND, LLMDeployment
from fleetllm.api.scaling import ScalingSpec
from fleetllm.operator import drain_hook
from fleetllm.operator.engine_pod import apply_cluster_settings
from fleetllm.operator.pod_env import CACHE_DIR, RUN_AS, base_env, engine_env, with_user_env
from fleetllm.operator.render_access import key_env, networkpolicy_name, render_networkpolicy
from fleetllm.planner.engine_argv import cpu_cores
from fleetllm.planner.placement import MODEL_CACHE_MOUNT, MODEL_MOUNT
from fleetllm.planner.plan import Plan
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig
from fleetllm.planner.timing import download_seconds, startup_seconds
from fleetllm.policy.check import pull_env
from fleetllm.scrape import KV_USAGE, QUEUE_TIME

CONFIG_DIR = "/etc/fleetllm"
# Time for endpoint removal to reach every router and kube-proxy before the drain hook starts
# watching the engine for its last requests.
PRESTOP_SECONDS = 10
# After the drain hook returns: SIGTERM, the engine's own drain of anything that came late,
# and its exit.
EXIT_SECONDS = 15
# The drain hook's source, passed inline: vLLM's image has python3 but not fleetllm.
DRAIN_HOOK_SOURCE = Path(drain_hook.__file__).read_text(encoding="utf-8")


def child_metadata(cr: LLMDeployment, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": child_labels(cr)}
    if cr.metadata.namespace:
        meta["namespace"] = cr.metadata.namespace
    if cr.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": cr.metadata.name,
                "uid": cr.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def _gib_quantity(value_bytes: int) -> str:
    return f"{max(1, math.ceil(value_bytes / GIB))}Gi"


def _engine_config(cr: LLMDeployment, plan: Plan) -> str:
    config = {
        "model": cr.spec.model.name,
        "source": cr.spec.model.source,
        "architecture": plan.arch.name,
        "command": list(plan.command),
        "args": list(plan.args),
        "plan": plan.status.model_dump(by_alias=True, exclude={"engine_args"}),
    }
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def render_configmap(cr: LLMDeployment, plan: Plan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(cr, child_names(cr.metadata.name)["ConfigMap"]),
        "data": {"engine.json": _engine_config(cr, plan)},
    }


def render_service(cr: LLMDeployment) -> dict[str, Any]:
    # Headless: the router picks replicas itself from the EndpointSlices, by load and prefix.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(cr, child_names(cr.metadata.name)["Service"]),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(cr.metadata.name),
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": ENGINE_PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                },
                # The router finds each replica's KV-event sockets on its EndpointSlices.
                *(
                    {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                    for name, port in kv_event_ports(cr).items()
                ),
            ],
        },
    }


def render_pdb(cr: LLMDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(cr, child_names(cr.metadata.name)["PodDisruptionBudget"]),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(cr.metadata.name)},
            # A replica that never turns ready must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def termination_grace_seconds(plan: Plan) -> int:
    return PRESTOP_SECONDS + plan.drain_seconds + EXIT_SECONDS


def _model_cache_bytes(plan: Plan) -> int:
    """Room for one model's download: its weights, tokenizer and config, with slack."""
    return plan.total_weights_bytes * 11 // 10 + GIB


def _scratch_volumes(plan: Plan, config: OperatorConfig) -> dict[str, int]:
    """emptyDir volumes on the node's disk -> size limit in bytes (the pod's
    ephemeral-storage request is their sum)."""
    sizes = {"cache": 2 * GIB, "tmp": GIB}
    if plan.fills_cache and config.model_cache is None:
        sizes["models"] = _model_cache_bytes(plan)
    return sizes


def _resources(cr: LLMDeployment, plan: Plan, config: OperatorConfig) -> dict[str, Any]:
    scratch = _gib_quantity(sum(_scratch_volumes(plan, config).values()))
    if plan.gpu.is_gpu:
        # Host memory to stage the weights of this replica's share while loading.
        memory = _gib_quantity(plan.total_weights_bytes + 8 * GIB)
        requests: dict[str, str] = {
            "cpu": str(4 * plan.devices),
            "memory": memory,
            GPU_RESOURCE: str(plan.devices),
        }
        limits: dict[str, str] = {"memory": memory, GPU_RESOURCE: str(plan.devices)}
    else:
        memory = _gib_quantity(plan.estimate.memory_bytes)
        requests = {"cpu": str(cpu_cores(cr.spec)), "memory": memory}
        limits = {"memory": memory}
    # The scheduler only counts node disk that is requested: the emptyDirs (a download among
    # them) must fit on the node.
    requests["ephemeral-storage"] = scratch
    overrides = cr.spec.pod.resources
    if overrides is not None:
        requests |= {key: str(value) for key, value in overrides.requests.items()}
        limits |= {key: str(value) for key, value in overrides.limits.items()}
    return {"requests": requests, "limits": limits}


def _env(cr: LLMDeployment) -> list[dict[str, Any]]:
    """The engine's environment, its key last (never one the spec names)."""
    key = key_env(cr)
    return [var for var in engine_env(cr) if var["name"] != key["name"]] + [key]


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _volumes(
    cr: LLMDeployment, plan: Plan, config: OperatorConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    names = child_names(cr.metadata.name)
    scratch = _scratch_volumes(plan, config)
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {"sizeLimit": _gib_quantity(scratch["cache"])}},
        {"name": "tmp", "emptyDir": {"sizeLimit": _gib_quantity(scratch["tmp"])}},
        {"name": "config", "configMap": {"name": names["ConfigMap"]}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    # A shared model cache is where hf:// and s3:// adapters are pulled to while the replicas
    # run: mounted in every replica that serves LoRA, whatever its model needs.
    adapters_in_cache = cr.spec.lora is not None and config.model_cache is not None
    if plan.fills_cache or adapters_in_cache:
        if config.model_cache is None:
            volumes.append(
                {"name": "models", "emptyDir": {"sizeLimit": _gib_quantity(scratch["models"])}}
            )
        else:
            claim: dict[str, Any] = {"claimName": config.model_cache.claim_name}
            if config.model_cache.read_only:
                claim["readOnly"] = True
            volumes.append({"name": "models", "persistentVolumeClaim": claim})
        mounts.append({"name": "models", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True})
    if plan.source.scheme == "pvc":
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": plan.source.location, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if plan.gpu.is_gpu:
        # Multi-GPU engines exchange tensors through shared memory; the default 64Mi is too small.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def pull_container(
    cr: LLMDeployment, config: OperatorConfig, *, image: str, source: str, dest: str
) -> dict[str, Any]:
    """The container that pulls `source` into the folder `dest` of the model cache (a no-op
    when the cache is a shared volume that already holds it): the engine pods' init container,
    and the pull Job of each hf:// and s3:// LoRA adapter."""
    read_only = config.model_cache is not None and config.model_cache.read_only
    return {
        "name": "model-pull",
        "image": image,
        "command": ["fleetllm", "model", "pull"],
        "args": [source, dest, *(["--read-only"] if read_only else [])],
        # Credentials (HF_TOKEN, AWS_*) come from the same variables the engine gets, and only
        # those the policy names: never an endpoint override that would fill a shared cache.
        "env": base_env() + pull_env(with_user_env([], cr), config.policy),
        "resources": {
            "requests": {"cpu": "1", "memory": "512Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [
            # readOnly only when set: the API server drops a false one, and a rendering must
            # match what it stores.
            {
                "name": "models",
                "mountPath": MODEL_CACHE_MOUNT,
                **({"readOnly": True} if read_only else {}),
            },
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
    }


def _drain_hook(plan: Plan) -> dict[str, Any]:
    """Hold SIGTERM until the replica has no running or waiting request (at most
    drainSeconds); the engine then drains whatever arrived late on its own."""
    command = [
        "python3",
        "-c",
        DRAIN_HOOK_SOURCE,
        str(PRESTOP_SECONDS),
        str(plan.drain_seconds),
        str(ENGINE_PORT),
    ]
    return {"preStop": {"exec": {"command": command}}}


def _pod_spec(cr: LLMDeployment, plan: Plan, config: OperatorConfig) -> dict[str, Any]:
    spec = cr.spec
    pod = spec.pod
    volumes, mounts = _volumes(cr, plan, config)
    startup = startup_seconds(plan)
    container: dict[str, Any] = {
        "name": "engine",
        "image": plan.status.image,
        "command": list(plan.command),
        "args": list(plan.args),
        "ports": [
            {"name": PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"},
            *(
                {"name": name, "containerPort": port, "protocol": "TCP"}
                for name, port in kv_event_ports(cr).items()
            ),
        ],
        "env": _env(cr),
        "resources": _resources(cr, plan, config),
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", 10, math.ceil(startup / 10)),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "lifecycle": _drain_hook(plan),
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
    }
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy

    # GPU node labels only when the profile asks for them: a label that appears once a node
    # runs (GPU feature discovery) keeps autoscalers from ever bringing that node.
    node_selector = {"kubernetes.io/os": "linux", **plan.node_selector}
    tolerations: list[dict[str, Any]] = []
    if plan.gpu.is_gpu:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    node_selector |= pod.node_selector
    tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in pod.tolerations]
    affinity = pod.affinity or {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": selector_labels(cr.metadata.name)},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(plan),
        "securityContext": copy.deepcopy(POD_SECURITY),
        "nodeSelector": node_selector,
        "affinity": affinity,
        "containers": [container],
        "volumes": volumes,
    }
    if plan.fills_cache:
        # A built-in model for vLLM is converted by fleetllm's engine image, the one that
        # ships the model's GGUF file and the converter.
        builtin = plan.source.scheme == "builtin"
        image = config.images.engine if builtin else config.images.model_pull
        pod_spec["initContainers"] = [
            pull_container(
                cr, config, image=image, source=cr.spec.model.source, dest=plan.model_path
            )
        ]
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    return pod_spec


def render_deployment(
    cr: LLMDeployment, plan: Plan, config: OperatorConfig = DEFAULT_CONFIG
) -> dict[str, Any]:
    name = cr.metadata.name
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        **cr.spec.pod.annotations,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(cr, child_names(name)["Deployment"]),
        "spec": {
            "replicas": cr.spec.desired_replicas(),
            "selector": {"matchLabels": selector_labels(name)},
            # A new replica must be ready before an old one goes: a model takes minutes to load.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            # The deadline covers the download (init container) and the load (startup probe).
            "progressDeadlineSeconds": download_seconds(plan) + startup_seconds(plan) + 300,
            "template": {
                "metadata": {"labels": child_labels(cr), "annotations": annotations},
                "spec": _pod_spec(cr, plan, config),
            },
        },
    }
    return apply_cluster_settings(deployment, cr, plan, config)


def _milli(value: float) -> str:
    """A fraction as a Kubernetes quantity (0.8 -> "800m")."""
    return f"{round(value * 1000)}m"


def _scale_target(cr: LLMDeployment) -> dict[str, str]:
    # HPA and KEDA scale the LLMDeployment through its scale subresource, so the operator keeps
    # spec.replicas within the bounds and the router can still scale it from zero.
    return {"apiVersion": API_VERSION, "kind": KIND, "name": cr.metadata.name}


def render_hpa(cr: LLMDeployment, scaling: ScalingSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the engines' KV-cache usage, read per pod through the custom
    metrics API (a metrics adapter must serve vllm:kv_cache_usage_perc)."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(cr, cr.metadata.name),
        "spec": {
            "scaleTargetRef": _scale_target(cr),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": KV_USAGE},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _milli(scaling.target_kv_cache_usage),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
                },
                # At most an hour, as the HPA takes (ScalingSpec refuses more for this mode).
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds},
            },
        },
    }


def render_scaledobject(cr: LLMDeployment, scaling: ScalingSpec) -> dict[str, Any]:
    """A KEDA ScaledObject with the builtin law's signals as Prometheus queries: summed KV-cache
    usage over its target (replicas the KV cache needs) and the p90 queue time over its target;
    with minReplicas 0, the router's held requests activate it from zero."""
    assert scaling.prometheus_address is not None
    namespace = cr.metadata.namespace or "default"
    engine = f'namespace="{namespace}",model_name="{cr.spec.model.name}"'

    def trigger(name: str, metric_type: str, query: str, threshold: str) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": name,
            "metricType": metric_type,
            "metadata": {
                "serverAddress": scaling.prometheus_address,
                "query": query,
                "threshold": threshold,
            },
        }

    triggers = [
        trigger(
            "kv-cache-usage",
            "AverageValue",
            f"sum({KV_USAGE}{{{engine}}})",
            f"{scaling.target_kv_cache_usage:g}",
        ),
        trigger(
            "queue-time-p90",
            "Value",
            f"histogram_quantile(0.9, sum by (le) (rate({QUEUE_TIME}_bucket{{{engine}}}[1m])))",
            f"{scaling.target_queue_time_seconds:g}",
        ),
    ]
    if scaling.min_replicas == 0:
        # Activation only: any held request wakes the model; the huge threshold keeps this
        # trigger from asking for more than one replica.
        demand = trigger(
            "router-held-requests",
            "Value",
            f'sum(fleetllm:router_held_requests{{model="{cr.spec.model.name}"}})',
            "1000000",
        )
        demand["metadata"]["activationThreshold"] = "0"
        triggers.append(demand)
    spec: dict[str, Any] = {
        "scaleTargetRef": _scale_target(cr),
        "minReplicaCount": scaling.min_replicas,
        "maxReplicaCount": scaling.max_replicas,
        "pollingInterval": 15,
        # Only minReplicas 0 reaches zero, and then scaleToZeroAfterSeconds is required.
        "cooldownPeriod": scaling.scale_to_zero_after_seconds or 300,
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "behavior": {
                    "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds}
                }
            }
        },
        "triggers": triggers,
    }
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(cr, cr.metadata.name),
        "spec": spec,
    }


def render_autoscaler(cr: LLMDeployment) -> dict[str, Any] | None:
    """The HPA or ScaledObject that scales the LLMDeployment instead of the operator's own
    autoscaler (spec.scaling.mode hpa or keda); None otherwise."""
    scaling = cr.spec.scaling
    if scaling is None or cr.spec.autoscaled_by_builtin:
        return None
    if scaling.mode == "hpa":
        return render_hpa(cr, scaling)
    return render_scaledobject(cr, scaling)


def content_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def render(
    cr: LLMDeployment, plan: Plan, config: OperatorConfig = DEFAULT_CONFIG
) -> list[dict[str, Any]]:
    """All children, in apply order; each annotated with the hash of its own rendering so a
    later reconcile can tell whether what is live was made from the same intent."""
    objects = [
        render_configmap(cr, plan),
        render_service(cr),
        render_deployment(cr, plan, config),
        render_pdb(cr),
        render_networkpolicy(cr, config, child_metadata(cr, networkpolicy_name(cr))),
    ]
    autoscaler = render_autoscaler(cr)
    if autoscaler is not None:
        objects.append(autoscaler)
    for obj in objects:
        obj["metadata"]["annotations"] = {ANNOTATION_APPLIED: content_hash(obj)}
    return objects
