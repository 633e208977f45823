"""Images from any registry: the chart's values, the operator's flags they become, and what an
operator so configured renders for every example LLMDeployment; an operator-only upgrade that
leaves engine pods as they are."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_operator import operator_config
from examples import ALL_EXAMPLES
from helmchart import CHART, NAMESPACE, RELEASE, by_kind, documents, pod_images, render, run, tool

from fleetllm.api.contract import ANNOTATION_APPLIED as APPLIED_HASH
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.images import (
    CONTROL_PLANE,
    CONTROL_PLANE_IMAGE,
    DEFAULT_ENGINE_IMAGES,
    MODEL_PULL_IMAGE,
    VLLM_VERSION,
    engine_images,
)
from fleetllm.operator.admission import review
from fleetllm.operator.render import render as render_children
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ALL_EXAMPLES
MIRROR = "mirror.example.com:5000/proxy"
DIGEST = "sha256:" + "ab" * 32


def _operator_config(objects: list[dict[str, Any]]) -> OperatorConfig:
    return operator_config(objects)


def _children(config: OperatorConfig) -> list[dict[str, Any]]:
    children = []
    for path in EXAMPLES:
        for cr in load_llmdeployments(path):
            try:
                result = plan(cr.spec, config)
            except PlanError:
                continue
            children += render_children(cr, result, config)
    return children


def _pod_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in by_kind(objects, "Deployment")]


def test_the_charts_defaults_are_the_operators() -> None:
    config = _operator_config(render())
    assert config.images == DEFAULT_ENGINE_IMAGES
    assert config.image_pull_secrets == ()
    # The chart names its release's namespace as the fleet's.
    assert dataclasses.replace(config, fleet_namespace=OperatorConfig.fleet_namespace) == (
        OperatorConfig()
    )


def test_a_mirror_moves_every_image_of_the_chart_and_of_every_engine_pod() -> None:
    objects = render(
        None,
        f"global.imageRegistry={MIRROR}",
        "imagePullSecrets[0].name=regcred",
        "imagePullSecrets[1].name=mirror-auth",
    )
    config = _operator_config(objects)
    children = _children(config)
    # Every example plans under the default profile: none is left out of the check.
    assert len(by_kind(children, "Deployment")) == sum(
        len(load_llmdeployments(p)) for p in EXAMPLES
    )
    images = pod_images(objects) | pod_images(children)
    assert {image for image in images if not image.startswith(f"{MIRROR}/")} == set()
    # Every image is used, each moved: the control plane, the builtin engine on CPU and on
    # CUDA, vLLM's GPU and CPU images, the model pull (the chart's templates moved them; the
    # operator's own code moves them alike).
    assert images == {CONTROL_PLANE.moved(MIRROR).reference, *astuple(engine_images(MIRROR))}
    assert f"{MIRROR}/vllm/vllm-openai:v{VLLM_VERSION}" in images
    assert f"{MIRROR}/q9t5s3a7/vllm-cpu-release-repo:v{VLLM_VERSION}" in images
    for pod in _pod_specs(objects) + _pod_specs(children):
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-auth"}]
    # The chart's policy lets the operator run its own mirrored images.
    for path in EXAMPLES:
        for cr in load_llmdeployments(path):
            report = review(cr, plan(cr.spec, config), config)
            assert [v for v in report.violations if v.rule == "allowedImageRegistries"] == []


def test_each_image_takes_its_own_repository_tag_and_digest() -> None:
    objects = render(
        None,
        "engine.images.cuda.registry=123456789012.dkr.ecr.us-east-1.amazonaws.com",
        "engine.images.cuda.repository=team/engine",
        "engine.images.cuda.tag=patched",
        f"engine.images.modelPull.digest={DIGEST}",
        f"image.digest={DIGEST}",
    )
    config = _operator_config(objects)
    assert config.images.engine_cuda == (
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/team/engine:patched"
    )
    assert config.images.model_pull == f"{MODEL_PULL_IMAGE}@{DIGEST}"
    assert config.images.engine == DEFAULT_ENGINE_IMAGES.engine
    assert f"{CONTROL_PLANE_IMAGE}@{DIGEST}" in pod_images(objects)
    assert config.images.engine_cuda in pod_images(_children(config))


def test_an_operator_only_upgrade_leaves_every_engine_pod_as_it_is() -> None:
    before = render(None, "image.tag=0.1.0")
    after = render(None, "image.tag=0.2.0")
    assert pod_images(before) != pod_images(after)  # the operator and the router do move
    children_before = _children(_operator_config(before))
    children_after = _children(_operator_config(after))
    assert children_before == children_after
    # The init container has a version of its own: no child names the control plane image.
    assert not {i for i in pod_images(children_after) if "control-plane" in i}
    assert MODEL_PULL_IMAGE in pod_images(children_after)


def _chart_release(tmp_path: Path, version: str) -> list[dict[str, Any]]:
    """The chart as a release of `version` would render it (Chart.yaml's version and
    appVersion moved, nothing else)."""
    chart = tmp_path / f"chart-{version}"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = meta["appVersion"] = version
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    rendered = run(tool("helm"), "template", RELEASE, str(chart), "--namespace", NAMESPACE)
    return documents(rendered.stdout)


def _without_engine_version(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the builtin engine images' version and the hash of what is applied blanked."""
    text = json.dumps(obj)
    for version in ("0.1.0", "0.2.0"):
        text = text.replace(f"fleetllm/engine:{version}", "fleetllm/engine:VERSION")
    blank = json.loads(text)
    blank["metadata"].get("annotations", {}).pop(APPLIED_HASH, None)
    return blank


def test_a_new_release_restarts_only_the_builtin_engines_whose_image_moves(
    tmp_path: Path,
) -> None:
    """A real upgrade moves appVersion: the control plane and the builtin engine images follow
    it; vLLM's images and the model-pull image do not. Only pods that run the builtin engine
    image restart: builtin engines, and the init container that converts the built-in model
    for vLLM (from the package in that image: no download). No other vLLM pod restarts, and no
    download runs again."""
    before = _children(_operator_config(_chart_release(tmp_path, "0.1.0")))
    after = _children(_operator_config(_chart_release(tmp_path, "0.2.0")))
    assert [_without_engine_version(o) for o in before] == [
        _without_engine_version(o) for o in after
    ]
    restarted, pulls_seen = [], 0
    for old, new in zip(by_kind(before, "Deployment"), by_kind(after, "Deployment"), strict=True):
        pods = [d["spec"]["template"]["spec"] for d in (old, new)]
        containers = [[*p.get("initContainers", []), *p["containers"]] for p in pods]
        pulls = [[c for c in cs if "/model-pull:" in c["image"]] for cs in containers]
        assert pulls[0] == pulls[1]
        pulls_seen += len(pulls[0])
        if old["spec"]["template"] != new["spec"]["template"]:
            assert any("fleetllm/engine:" in c["image"] for c in containers[0])
            restarted.append(old["metadata"]["name"])
    builtin_image = {
        f"{cr.metadata.name}-engine"
        for path in EXAMPLES
        for cr in load_llmdeployments(path)
        if cr.spec.engine.backend == "builtin" or cr.spec.model.source.startswith("builtin://")
    }
    assert sorted(restarted) == sorted(builtin_image)
    assert pulls_seen >= 2
    assert len(by_kind(before, "Deployment")) > len(restarted)  # vLLM pods of other models stay


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetllm", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fleetllm_render_takes_the_registry_and_pull_secrets() -> None:
    example = str(ROOT / "manifests" / "examples" / "qwen2.5-7b-vllm-a10g.yaml")
    result = _cli(
        "render",
        "-f",
        example,
        "--image-registry",
        MIRROR,
        "--image-pull-secret",
        "regcred",
        "--image-pull-secret",
        "other",
    )
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    assert pod_images(objects) == {
        f"{MIRROR}/fleetllm/model-pull:1",
        engine_images(MIRROR).vllm,
    }
    (pod,) = _pod_specs(objects)
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image-registry", "https://mirror.example.com"], "--image-registry"),
        (["--image-pull-secret", "Bad_Name"], "--image-pull-secret"),
    ],
)
def test_fleetllm_render_refuses_bad_image_flags(args: list[str], message: str) -> None:
    example = str(ROOT / "manifests" / "examples" / "smollm2-cpu.yaml")
    result = _cli("render", "-f", example, *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_image_list_of_the_build_script_follows_a_registry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm.images", "registry.local:5000"],
        capture_output=True,
        text=True,
        check=True,
    )
    references = [line.split()[1] for line in result.stdout.splitlines()]
    assert references and all(r.startswith("registry.local:5000/fleetllm/") for r in references)
    bad = subprocess.run(
        [sys.executable, "-m", "fleetllm.images", "http://x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "registry" in bad.stderr
