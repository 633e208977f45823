"""The flags of where engine images come from and of the admin's engine pod settings, shared
by `fleetllm plan`, `render` and `operator run` (the chart passes the same ones), so that a
render shows what an operator so configured applies."""

from __future__ import annotations

import argparse
import re
from typing import Any

from fleetllm.api.deployment import NAME_PATTERN
from fleetllm.images import engine_images
from fleetllm.planner.pod_settings import EnginePodSettings, parse_pod_settings

_IMAGE_FLAGS = {
    "engine_image": "--engine-image",
    "engine_cuda_image": "--engine-cuda-image",
    "vllm_image": "--vllm-image",
    "vllm_cpu_image": "--vllm-cpu-image",
    "model_pull_image": "--model-pull-image",
}


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("images")
    g.add_argument(
        "--image-registry",
        metavar="REGISTRY",
        help="pull every default engine image from this registry (HOST[:PORT][/PATH]), "
        "e.g. a mirror: ghcr.io/fleetllm/engine:V becomes REGISTRY/fleetllm/engine:V",
    )
    g.add_argument(
        "--image-pull-secret",
        metavar="NAME",
        action="append",
        default=[],
        help="a Secret (in each model's namespace) with registry credentials, given to every "
        "engine pod; repeatable",
    )
    for dest, flag in _IMAGE_FLAGS.items():
        what = dest.removesuffix("_image").replace("_", " ")
        g.add_argument(flag, metavar="IMAGE", help=f"the {what} image, in full (not moved)")
    g.add_argument(
        "--engine-pod-settings",
        metavar="JSON",
        help="the admin's settings of every engine pod, as the chart's engine.pod values: "
        '{"runtimeClassName": "nvidia", "shmSize": "16Gi", "rollout": {"maxSurge": 0, '
        '"maxUnavailable": 1}, "probes": {...}, "extraEnv": [...], "extraVolumes": [...], '
        '"extraVolumeMounts": [...]}',
    )


def cluster_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """OperatorConfig's images, image_pull_secrets and pod fields; ValueError naming the flag
    that is wrong."""
    for name in args.image_pull_secret:
        if not re.match(NAME_PATTERN, name) or len(name) > 253:
            raise ValueError(f"--image-pull-secret {name!r} is not a valid Secret name")
    try:
        images = engine_images(
            args.image_registry,
            **{dest[: -len("_image")]: getattr(args, dest) for dest in _IMAGE_FLAGS},
        )
    except ValueError as error:
        raise ValueError(f"--image-registry: {error}") from None
    pod = EnginePodSettings()
    if args.engine_pod_settings:
        try:
            pod = parse_pod_settings(args.engine_pod_settings)
        except ValueError as error:
            raise ValueError(f"--engine-pod-settings: {error}") from None
    return {
        "images": images,
        "image_pull_secrets": tuple(dict.fromkeys(args.image_pull_secret)),
        "pod": pod,
    }
