"""The built-in model served by vLLM in a cluster: vLLM cannot read its GGUF file, so the pod's
pull init container runs fleetllm's engine image (which ships the model and the converter) and
converts it into the model cache; vLLM's CPU image then loads that folder."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubeschemas
import pytest
from examples import VLLM_BUILTIN

from fleetllm.api.manifests import load_llmdeployments
from fleetllm.images import ENGINE_IMAGE, MODEL_PULL_IMAGE, VLLM_CPU_IMAGE
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import DEFAULT_CONFIG, ModelCache, OperatorConfig

FOLDER = "/var/lib/fleetllm/models/builtin/smollm2-135m"
MIRRORED = replace(DEFAULT_CONFIG.images, engine="mirror.example/fleetllm/engine:0.1.0")


def _pod(config: OperatorConfig) -> dict[str, Any]:
    (cr,) = load_llmdeployments(VLLM_BUILTIN)
    meta = cr.metadata.model_copy(
        update={"uid": "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f", "namespace": "models"}
    )
    objects = render(cr.model_copy(update={"metadata": meta}), plan(cr.spec, config), config)
    for obj in objects:
        kubeschemas.validate(obj, "1.30")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "config",
    [DEFAULT_CONFIG, OperatorConfig(model_cache=ModelCache("model-cache"), images=MIRRORED)],
    ids=["emptydir", "shared-cache-mirrored"],
)
def test_the_engine_image_converts_the_model_into_the_cache_and_vllm_loads_it(
    config: OperatorConfig,
) -> None:
    pod = _pod(config)
    (pull,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert engine["image"] == VLLM_CPU_IMAGE and engine["args"][0] == FOLDER
    # The operator's engine image (a mirror's when configured), not the model-pull image.
    assert pull["image"] == config.images.engine != MODEL_PULL_IMAGE
    assert pull["command"] == ["fleetllm", "model", "pull"]
    assert pull["args"] == ["builtin://smollm2-135m", FOLDER]
    assert {"name": "models", "mountPath": "/var/lib/fleetllm/models"} in pull["volumeMounts"]
    assert {
        "name": "models",
        "mountPath": "/var/lib/fleetllm/models",
        "readOnly": True,
    } in engine["volumeMounts"]
    # Locked down as the engine is.
    security = pull["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    # The converted float32 folder (about 0.5 GiB) fits the per-pod cache, when there is one.
    volumes = {v["name"]: v for v in pod["volumes"]}
    if config.model_cache is None:
        assert volumes["models"]["emptyDir"]["sizeLimit"] == "2Gi"
    else:
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "model-cache"}


def test_a_read_only_cache_is_only_checked() -> None:
    config = OperatorConfig(model_cache=ModelCache("model-cache", read_only=True))
    (pull,) = _pod(config)["initContainers"]
    assert pull["image"] == ENGINE_IMAGE
    assert pull["args"] == ["builtin://smollm2-135m", FOLDER, "--read-only"]
