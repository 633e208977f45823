"""The cluster's settings applied to a rendered engine Deployment: image pull secrets and the
admin's engine pod settings (planner/pod_settings.py). Pure: a rendered Deployment in, a new
one out. With the default settings the Deployment comes out unchanged, so that a cluster that
sets nothing keeps its pods across operator upgrades."""

from __future__ import annotations

import copy
import math
from typing import Any

from fleetllm.api.deployment import LLMDeployment
from fleetllm.planner.gpu_affinity import pinning_affinity
from fleetllm.planner.plan import Plan
from fleetllm.planner.settings import OperatorConfig

# The startup probe's period (render.py): extra start-up seconds become failures of it.
STARTUP_PERIOD_SECONDS = 10


def _tune_probes(container: dict[str, Any], config: OperatorConfig) -> None:
    probes = config.pod.probes
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        if key in container:
            container[key]["timeoutSeconds"] = probes.timeout_seconds
    if "livenessProbe" in container:
        container["livenessProbe"]["failureThreshold"] = probes.liveness_failure_threshold
    if "readinessProbe" in container:
        container["readinessProbe"]["failureThreshold"] = probes.readiness_failure_threshold
    if "startupProbe" in container and probes.startup_extra_seconds:
        extra = math.ceil(probes.startup_extra_seconds / STARTUP_PERIOD_SECONDS)
        container["startupProbe"]["failureThreshold"] += extra


def _with_extra_env(env: list[dict[str, Any]], extra: tuple[dict[str, Any], ...]) -> list:
    """The admin's variables after the renderer's and the LLMDeployment's; a name set twice
    keeps the admin's value (one name once: server-side apply refuses duplicates)."""
    names = {var["name"] for var in extra}
    return [var for var in env if var["name"] not in names] + [copy.deepcopy(v) for v in extra]


def apply_cluster_settings(
    deployment: dict[str, Any], cr: LLMDeployment, plan: Plan, config: OperatorConfig
) -> dict[str, Any]:
    settings = config.pod
    out = copy.deepcopy(deployment)
    spec = out["spec"]
    profile = cr.spec.gpu.node_selector_profile or config.gpu_profile
    # An LLMDeployment's own affinity replaces the renderer's, pinning included.
    if profile == "auto" and plan.gpu.is_gpu and cr.spec.pod.affinity is None:
        spec["template"]["spec"]["affinity"]["nodeAffinity"] = pinning_affinity(plan.gpu)
    spec["strategy"]["rollingUpdate"] = {
        "maxSurge": settings.rollout.max_surge,
        "maxUnavailable": settings.rollout.max_unavailable,
    }
    pod = spec["template"]["spec"]
    if settings.runtime_class_name:
        pod["runtimeClassName"] = settings.runtime_class_name
    for volume in pod["volumes"]:
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = settings.shm_size
    _tune_probes(pod["containers"][0], config)
    add_cluster_extras(pod, config)
    return out


def add_cluster_extras(pod: dict[str, Any], config: OperatorConfig) -> None:
    """What every pod the operator makes gets from the cluster's settings: the image pull
    secrets, and the admin's extra env, volumes and mounts in each container (the model pull
    too: a proxy or a CA bundle matters most to a download)."""
    settings = config.pod
    if config.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    pod["volumes"] += [copy.deepcopy(volume) for volume in settings.extra_volumes]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        if settings.extra_env:
            container["env"] = _with_extra_env(container.get("env", []), settings.extra_env)
        container["volumeMounts"] += [copy.deepcopy(m) for m in settings.extra_volume_mounts]
