"""The cluster admin's settings of every engine pod: what no LLMDeployment states but a GPU
cluster needs (the nvidia runtime class, a larger /dev/shm, probe and rollout tuning, extra env,
volumes and mounts such as a CA bundle or a proxy). `fleetllm operator run`, `plan` and `render`
read them from `--engine-pod-settings` (JSON, the chart's engine.pod values). Pure data."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fleetllm.planner.placement import MODEL_CACHE_MOUNT, MODEL_MOUNT

# Names and paths the renderer itself uses: an extra volume or mount may not take them.
RESERVED_VOLUMES = frozenset({"cache", "tmp", "config", "models", "model", "dshm"})
RESERVED_MOUNTS = frozenset(
    {"/var/cache/fleetllm", "/tmp", "/etc/fleetllm", MODEL_MOUNT, MODEL_CACHE_MOUNT, "/dev/shm"}
)
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
# Upper bounds (values.schema.json has the same): beyond them a value is a typo, and the
# startup probe's failure threshold stays far inside Kubernetes' int32.
MAX_ROLLOUT = 1000
MAX_PROBE_TIMEOUT_SECONDS = 3600
MAX_FAILURES = 1000
MAX_STARTUP_EXTRA = 86400
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class PodSettingsError(ValueError):
    """A setting that cannot be honoured; the message names it."""


@dataclass(frozen=True)
class Rollout:
    max_surge: int = 1
    """Replicas started above the desired count during a rollout. 0 on full GPU pools, where
    the surge replica never schedules and the rollout stalls (max_unavailable must then be 1+)."""
    max_unavailable: int = 0


@dataclass(frozen=True)
class Probes:
    timeout_seconds: int = 5
    liveness_failure_threshold: int = 6
    readiness_failure_threshold: int = 3
    startup_extra_seconds: int = 0
    """Added to the planned start-up budget (slow disks, cold image caches)."""


@dataclass(frozen=True)
class EnginePodSettings:
    runtime_class_name: str | None = None
    shm_size: str = "8Gi"
    """/dev/shm of GPU engines (tensors between ranks, NCCL)."""
    rollout: Rollout = Rollout()
    probes: Probes = Probes()
    extra_env: tuple[dict[str, Any], ...] = ()
    extra_volumes: tuple[dict[str, Any], ...] = ()
    extra_volume_mounts: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.runtime_class_name is not None and not _DNS_LABEL.match(self.runtime_class_name):
            raise PodSettingsError(f"runtimeClassName {self.runtime_class_name!r} is not a name")
        if not _QUANTITY.match(self.shm_size) or float(re.sub(r"[A-Za-z]", "", self.shm_size)) == 0:
            raise PodSettingsError(f"shmSize {self.shm_size!r} is not a size such as 8Gi")
        rollout, probes = self.rollout, self.probes
        for name, value, low, high in (
            ("rollout.maxSurge", rollout.max_surge, 0, MAX_ROLLOUT),
            ("rollout.maxUnavailable", rollout.max_unavailable, 0, MAX_ROLLOUT),
            ("probes.timeoutSeconds", probes.timeout_seconds, 1, MAX_PROBE_TIMEOUT_SECONDS),
            ("probes.livenessFailureThreshold", probes.liveness_failure_threshold, 1, MAX_FAILURES),
            (
                "probes.readinessFailureThreshold",
                probes.readiness_failure_threshold,
                1,
                MAX_FAILURES,
            ),
            ("probes.startupExtraSeconds", probes.startup_extra_seconds, 0, MAX_STARTUP_EXTRA),
        ):
            if not low <= value <= high:
                raise PodSettingsError(f"{name} must be {low} to {high}, not {value}")
        if rollout.max_surge == 0 and rollout.max_unavailable == 0:
            raise PodSettingsError(
                "rollout.maxSurge 0 needs rollout.maxUnavailable 1 or more (else no rollout moves)"
            )
        self._check_extras()

    def _check_extras(self) -> None:
        names = set()
        for var in self.extra_env:
            if not isinstance(var.get("name"), str) or not _ENV_NAME.match(var["name"]):
                raise PodSettingsError(f"extraEnv entry {var!r} has no valid name")
            if var["name"] in names:  # server-side apply refuses a name twice
                raise PodSettingsError(f"extraEnv sets {var['name']!r} twice")
            names.add(var["name"])
        volumes = set()
        for volume in self.extra_volumes:
            name = volume.get("name")
            if not isinstance(name, str) or not _DNS_LABEL.match(name):
                raise PodSettingsError(f"extraVolumes entry {volume!r} has no valid name")
            if name in RESERVED_VOLUMES or name in volumes:
                raise PodSettingsError(f"extraVolumes: the volume name {name!r} is taken")
            volumes.add(name)
        paths = set()
        for mount in self.extra_volume_mounts:
            if mount.get("name") not in volumes:
                raise PodSettingsError(
                    f"extraVolumeMounts entry {mount!r} names no volume of extraVolumes"
                )
            path = str(mount.get("mountPath", ""))
            if not path.startswith("/"):
                raise PodSettingsError(f"extraVolumeMounts entry {mount!r} has no absolute path")
            if path.rstrip("/") in RESERVED_MOUNTS:
                raise PodSettingsError(f"extraVolumeMounts: the path {path!r} is the engine's own")
            if path.rstrip("/") in paths:  # the API server refuses a path mounted twice
                raise PodSettingsError(f"extraVolumeMounts mounts {path!r} twice")
            paths.add(path.rstrip("/"))


_KEYS = {
    "runtimeClassName",
    "shmSize",
    "rollout",
    "probes",
    "extraEnv",
    "extraVolumes",
    "extraVolumeMounts",
}
_ROLLOUT = {"maxSurge": "max_surge", "maxUnavailable": "max_unavailable"}
_PROBES = {
    "timeoutSeconds": "timeout_seconds",
    "livenessFailureThreshold": "liveness_failure_threshold",
    "readinessFailureThreshold": "readiness_failure_threshold",
    "startupExtraSeconds": "startup_extra_seconds",
}


def _fields(section: str, given: Any, names: dict[str, str]) -> dict[str, int]:
    if not isinstance(given, dict):
        raise PodSettingsError(f"{section} must be an object")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise PodSettingsError(f"unknown field {section}.{unknown[0]}")
    for key, value in given.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise PodSettingsError(f"{section}.{key} must be an integer")
    return {names[key]: value for key, value in given.items()}


def _objects(name: str, given: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(given, list) or not all(isinstance(item, dict) for item in given):
        raise PodSettingsError(f"{name} must be a list of objects")
    return tuple(given)


def parse_pod_settings(text: str) -> EnginePodSettings:
    """The settings of a JSON object (the chart's engine.pod); PodSettingsError naming the
    field that is unknown or wrong."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise PodSettingsError(f"not JSON: {error}") from None
    if not isinstance(given, dict):
        raise PodSettingsError("must be a JSON object")
    unknown = sorted(set(given) - _KEYS)
    if unknown:
        raise PodSettingsError(f"unknown field {unknown[0]}")
    runtime = given.get("runtimeClassName") or None
    shm = given.get("shmSize", "8Gi")
    if not isinstance(shm, str) or (runtime is not None and not isinstance(runtime, str)):
        raise PodSettingsError("runtimeClassName and shmSize must be strings")
    return EnginePodSettings(
        runtime_class_name=runtime,
        shm_size=shm,
        rollout=Rollout(**_fields("rollout", given.get("rollout", {}), _ROLLOUT)),
        probes=Probes(**_fields("probes", given.get("probes", {}), _PROBES)),
        extra_env=_objects("extraEnv", given.get("extraEnv", [])),
        extra_volumes=_objects("extraVolumes", given.get("extraVolumes", [])),
        extra_volume_mounts=_objects("extraVolumeMounts", given.get("extraVolumeMounts", [])),
    )
