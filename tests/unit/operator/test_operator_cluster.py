"""What the operator renders can run on a real GPU cluster: every image it names is one this
repository builds (or the pinned vLLM image), engine pods get their device, GPU node labels only
where the profile asks for them, downloaded weights get a pull init container and disk, and
claims the replicas cannot share are refused.

No container runtime is available where the tests run, so the images are not built here: the
Dockerfiles are linted (hadolint) and checked for the properties the images must have.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubeschemas
import pytest
import yaml
from examples import ALL_EXAMPLES

from fleetllm.api.catalog import (
    GKE_ACCELERATOR_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_PROFILES,
    GPU_TYPES,
    KARPENTER_GPU_MEMORY_LABEL,
    KARPENTER_GPU_NAME_LABEL,
    GPUType,
)
from fleetllm.api.deployment import LLMDeployment, LLMDeploymentSpec
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.images import (
    BUILT_IMAGES,
    MODEL_PULL_IMAGE,
    MODEL_PULL_VERSION,
    UPSTREAM_IMAGES,
    VLLM_CPU_IMAGE,
    VLLM_IMAGE,
    built_image,
)
from fleetllm.operator.render import render
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import ModelCache, OperatorConfig
from fleetllm.planner.vllm_args import vllm_flags
from fleetllm.version import __version__

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ALL_EXAMPLES
GPU_LABELS = {
    GPU_PRODUCT_LABEL,
    GKE_ACCELERATOR_LABEL,
    KARPENTER_GPU_NAME_LABEL,
    KARPENTER_GPU_MEMORY_LABEL,
}
CONFIGS = [
    OperatorConfig(),
    *(OperatorConfig(gpu_profile=p) for p in GPU_PROFILES if p != "auto"),
    OperatorConfig(model_cache=ModelCache("model-cache")),
    OperatorConfig(gpu_profile="gke", model_cache=ModelCache("model-cache", read_only=True)),
]


def _owned(cr: LLMDeployment) -> LLMDeployment:
    meta = cr.metadata.model_copy(
        update={"uid": "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f", "namespace": "models"}
    )
    return cr.model_copy(update={"metadata": meta})


def _examples() -> list[LLMDeployment]:
    return [cr for path in EXAMPLES for cr in load_llmdeployments(path)]


def _deployments(config: OperatorConfig) -> list[tuple[LLMDeployment, dict[str, Any]]]:
    """(LLMDeployment, Deployment) of every example that `config` plans."""
    deployments = []
    for cr in _examples():
        try:
            result = plan(cr.spec, config)
        except PlanError as exc:
            # Only a profile without a label for the example's GPU may refuse it.
            assert exc.reason == "NoNodeLabelForGPU", exc.message
            continue
        (deployment,) = [o for o in render(_owned(cr), result, config) if o["kind"] == "Deployment"]
        deployments.append((cr, deployment))
    return deployments


def _pods(config: OperatorConfig) -> list[tuple[LLMDeployment, dict[str, Any]]]:
    """(LLMDeployment, pod spec) of every example that `config` plans."""
    return [(cr, d["spec"]["template"]["spec"]) for cr, d in _deployments(config)]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


# -- every example, every configuration: valid objects ------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.gpu_profile}-{c.model_cache}")
def test_every_example_renders_valid_kubernetes_under_every_configuration(
    config: OperatorConfig,
) -> None:
    deployments = _deployments(config)
    # The configuration changes only the Deployment (test_operator_render validates all of
    # the default rendering).
    for _, deployment in deployments:
        for version in ("1.30", "1.37"):
            kubeschemas.validate(deployment, version)
    assert len(deployments) >= len(EXAMPLES) - 3


# -- images ----------------------------------------------------------------------------------


def test_every_image_the_renderer_and_the_manifests_use_is_built_here_or_the_pinned_vllm() -> None:
    used = {
        container["image"]
        for config in CONFIGS
        for _, pod in _pods(config)
        for container in _containers(pod)
    }
    assert VLLM_IMAGE in used
    # manifests/base is the chart with its default values (test_chart_manifests.py).
    used |= {
        container["image"]
        for obj in yaml.safe_load_all((ROOT / "manifests" / "base" / "fleetllm.yaml").read_text())
        if obj and obj["kind"] == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
    }
    built = {image.reference for image in BUILT_IMAGES}
    assert used <= built | set(UPSTREAM_IMAGES), used - built
    # Each built image is used; the version constant tags every one of them but the model
    # pull's, which has a version of its own (an operator upgrade leaves engine pods alone).
    assert built <= used
    for reference in built - {MODEL_PULL_IMAGE}:
        assert reference.split(":")[1].startswith(__version__)
    assert MODEL_PULL_IMAGE.endswith(f":{MODEL_PULL_VERSION}")


def test_examples_do_not_pin_images_of_their_own() -> None:
    for cr in _examples():
        assert cr.spec.engine.image is None, cr.metadata.name


def _stages(dockerfile: Path) -> list[list[str]]:
    """Instructions (continuation lines joined) split into build stages."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    stages: list[list[str]] = []
    for line in instructions:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("image", BUILT_IMAGES, ids=lambda i: Path(i.dockerfile).stem)
def test_dockerfiles_are_multi_stage_pinned_non_root_and_lint_clean(image: Any) -> None:
    dockerfile = ROOT / image.dockerfile
    assert built_image(image.reference) is image
    hadolint = Path(sys.executable).with_name("hadolint")
    result = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, json.loads(result.stdout or "[]") or result.stderr

    stages = _stages(dockerfile)
    assert len(stages) >= 2, "multi-stage: build tools stay in the build stage"
    for stage in stages:
        base = stage[0].split()[1]
        # Pinned: an exact patch version tag or a digest, never a floating one.
        assert re.search(r"@sha256:[0-9a-f]{64}$|:\d+\.\d+\.\d+[-.\w]*$", base), base
    final = stage_text = "\n".join(stages[-1])
    assert "COPY --from=build" in stage_text
    # Nothing is installed in the final stage: no package manager, no compiler, no pip; but
    # the CUDA engine's, where Triton builds each kernel's launcher with gcc at its first
    # launch (without it every kernel fails and the engine runs on torch attention).
    if image.dockerfile == "docker/engine-cuda.Dockerfile":
        assert re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", final)
        # GKE's device plugin mounts the driver's libraries there without telling the loader.
        (path,) = re.findall(r"\bLD_LIBRARY_PATH=(\S+)", final)
        assert "/usr/local/nvidia/lib64" in path.split(":")
        assert "rm -rf /var/lib/apt/lists/*" in final
        final = re.sub(r"RUN apt-get update .*?/var/lib/apt/lists/\*", "", final)
    assert not re.search(r"apt-get|apk |pip install|gcc|build-essential|make ", final)
    # A named, non-root user, and the image runs as it.
    useradd = re.search(r"useradd .*--uid (\d+) .* (\w+)$", final, re.MULTILINE)
    assert useradd, "the final stage creates a named user"
    uid, name = useradd.groups()
    assert int(uid) != 0
    user = [line for line in stages[-1] if line.startswith("USER ")][-1].split()[1]
    assert user.split(":")[0] in {uid, name}
    assert stages[-1][-1].startswith(("CMD", "ENTRYPOINT")) or "ENTRYPOINT" in final


def test_the_build_script_builds_every_image_from_the_version_constant() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm.images"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line.split() for line in result.stdout.splitlines()]
    assert lines == [[i.dockerfile, i.reference] for i in BUILT_IMAGES]
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    assert "fleetllm.images" in script and "VERSION=$version" in script


def test_the_control_plane_commands_run_without_the_engines_dependencies(tmp_path: Path) -> None:
    """The control-plane image leaves out torch and the engine's other dependencies
    (docker/requirements.py): its commands must not import them."""
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import requirements
    finally:
        sys.path.pop(0)
    excluded = {name.replace("-", "_") for name in requirements.ENGINE_ONLY}
    kept = requirements.requirements("control-plane", ROOT / "pyproject.toml")
    assert {requirements.requirement_name(r) for r in kept} & requirements.ENGINE_ONLY == set()
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(excluded)!r}:\n"
        "            raise ImportError(f'{name} is not in the control-plane image')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    code = (
        "import sys\n"
        "from fleetllm.cli import build_parser\n"
        "import fleetllm.operator.handlers, fleetllm.router.server, fleetllm.weights.pull\n"
        "from fleetllm.cli import main\n"
        "for argv in (['operator', 'run', '--help'], ['router', 'serve', '--help'],\n"
        "             ['model', 'pull', '--help'], ['crds']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), argv\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("False")


# -- GPUs: device, node labels --------------------------------------------------------------


def test_builtin_engines_get_the_planned_device() -> None:
    seen = set()
    for cr, pod in _pods(OperatorConfig()):
        (container,) = pod["containers"]
        if cr.spec.engine.backend != "builtin":
            assert "--device" not in container["args"]
            continue
        device = _arg(container, "--device")
        wants_gpu = "nvidia.com/gpu" in container["resources"]["limits"]
        assert device == ("cuda" if wants_gpu else "cpu"), cr.metadata.name
        assert plan(cr.spec).status.device == device
        seen.add(device)
    assert seen == {"cuda", "cpu"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.gpu_profile}-{c.model_cache}")
def test_no_gpu_label_selector_unless_the_profile_asks_for_it(config: OperatorConfig) -> None:
    for cr, pod in _pods(config):
        profile = cr.spec.gpu.node_selector_profile or config.gpu_profile
        selected = set(pod["nodeSelector"]) & GPU_LABELS
        gpu = GPU_TYPES[cr.spec.gpu.type]
        affinity = pod.get("affinity", {})
        if profile == "auto" and gpu.is_gpu and cr.spec.pod.affinity is None:
            # auto: only NotIn, which a node without the label matches (autoscalers too).
            (term,) = affinity.pop("nodeAffinity")[
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
            assert {e["operator"] for e in term["matchExpressions"]} == {"NotIn"}
            assert gpu.product_label not in term["matchExpressions"][0]["values"]
        assert not any(label in json.dumps(affinity) for label in GPU_LABELS)
        if profile in ("none", "auto") or not gpu.is_gpu:
            assert selected == set(), cr.metadata.name
        else:
            expected = gpu.node_labels(profile)
            assert expected
            assert {k: pod["nodeSelector"][k] for k in selected} == expected


def _schedulable(pod: dict[str, Any], node_labels: dict[str, str]) -> bool:
    """Whether a node with these labels passes the pod's required node affinity (NotIn and In,
    as the scheduler evaluates them) and its node selector."""
    if any(node_labels.get(k) != v for k, v in pod["nodeSelector"].items() if k in GPU_LABELS):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {})
    terms = required.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    for term in terms.get("nodeSelectorTerms", [{"matchExpressions": []}]):
        ok = True
        for e in term["matchExpressions"]:
            value = node_labels.get(e["key"])
            if e["operator"] == "NotIn":
                ok &= value is None or value not in e["values"]
            else:
                ok &= value in e["values"]
        if ok:
            return True
    return False


def _gfd_labels(gpu: GPUType) -> dict[str, str]:
    return {GPU_PRODUCT_LABEL: gpu.product_label} if gpu.product_label else {}


def _gke_labels(gpu: GPUType) -> dict[str, str]:
    return {GKE_ACCELERATOR_LABEL: gpu.gke_accelerator} if gpu.gke_accelerator else {}


def _karpenter_labels(gpu: GPUType) -> dict[str, str]:
    if not gpu.karpenter_name:
        return {}
    return {
        KARPENTER_GPU_NAME_LABEL: gpu.karpenter_name,
        KARPENTER_GPU_MEMORY_LABEL: str(gpu.memory_mib),
    }


def test_the_auto_profile_avoids_nodes_labelled_as_another_gpu() -> None:
    config = OperatorConfig()
    assert config.gpu_profile == "auto"
    pods = {cr.metadata.name: (cr, pod) for cr, pod in _pods(config)}
    checked = 0
    for cr, pod in pods.values():
        gpu = GPU_TYPES[cr.spec.gpu.type]
        if not gpu.is_gpu or cr.spec.gpu.node_selector_profile:
            continue
        assert _schedulable(pod, {})  # unlabelled nodes, an autoscaler's template
        for other in GPU_TYPES.values():
            if not other.is_gpu:
                continue
            # A node as each labeller marks it: it fits only where the labels are the planned
            # GPU's (Karpenter names both A100s alike: their memory label differs).
            for family in (_gfd_labels, _gke_labels, _karpenter_labels):
                labels = family(other)
                if labels:
                    fits = _schedulable(pod, labels)
                    assert fits == (labels == family(gpu)), (cr.metadata.name, labels)
        checked += 1
    assert checked >= 3


def test_profiles_use_each_clusters_own_labels() -> None:
    a100 = GPU_TYPES["A100-80GB"]
    assert a100.node_labels("gke") == {GKE_ACCELERATOR_LABEL: "nvidia-a100-80gb"}
    # Karpenter names both A100s `a100`: the memory label tells them apart.
    assert a100.node_labels("karpenter") == {
        KARPENTER_GPU_NAME_LABEL: "a100",
        KARPENTER_GPU_MEMORY_LABEL: "81920",
    }
    assert GPU_TYPES["L4"].node_labels("gfd") == {GPU_PRODUCT_LABEL: "NVIDIA-L4"}
    assert GPU_TYPES["L4"].node_labels("none") == {}
    assert GPU_TYPES["cpu"].node_labels("gke") == {}
    assert GPU_TYPES["GH200"].node_labels("gke") is None  # GKE offers no GH200


def _spec(**fields: Any) -> LLMDeploymentSpec:
    base: dict[str, Any] = {
        "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
        "gpu": {"type": "H100-80GB"},
        "maxModelLen": 32768,
    }
    return LLMDeploymentSpec.model_validate(base | fields)


def _cr(name: str, spec: LLMDeploymentSpec) -> LLMDeployment:
    return LLMDeployment.model_validate(
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": name},
            "spec": spec.model_dump(by_alias=True, exclude_none=True),
        }
    )


PVC_LLAMA = {"name": "llama", "source": "pvc://store/llama", "architecture": "Llama-3.1-8B"}


def test_an_llmdeployment_overrides_or_drops_the_operators_profile() -> None:
    gke = OperatorConfig(gpu_profile="gke")
    assert plan(_spec(), gke).node_selector == {GKE_ACCELERATOR_LABEL: "nvidia-h100-80gb"}
    dropped = _spec(gpu={"type": "H100-80GB", "nodeSelectorProfile": "none"})
    assert plan(dropped, gke).node_selector == {}
    own = _spec(
        gpu={"type": "H100-80GB", "nodeSelectorProfile": "none"},
        pod={"nodeSelector": {"pool": "h100"}},
    )
    objects = render(_cr("x", own), plan(own, gke), gke)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "pool": "h100",
    }


def test_the_new_catalog_gpus_plan() -> None:
    for name, expect_dtype in (
        ("L40S", "bfloat16"),
        ("T4", "float16"),
        ("H100-NVL", "bfloat16"),
        ("GH200", "bfloat16"),
        ("B200", "bfloat16"),
    ):
        small = {"name": "llama", "source": "hf://meta-llama/Llama-3.2-3B-Instruct"}
        status = plan(_spec(model=small, gpu={"type": name}, maxModelLen=4096)).status
        assert (status.gpu_type, status.dtype, status.device) == (name, expect_dtype, "cuda")
    # Marlin kernels need Ampere: a T4 gets vLLM's plain AWQ kernels.
    t4 = plan(
        _spec(
            gpu={"type": "T4"},
            engine={"backend": "vllm"},
            quantization={"weights": "awq"},
            maxModelLen=4096,
        )
    )
    assert _arg({"args": t4.status.engine_args}, "--quantization") == "awq"


# -- weights: the pull init container, disk, claims ---------------------------------------


def test_an_hf_builtin_pod_pulls_its_weights_first_into_requested_disk() -> None:
    pods = [
        (cr, pod)
        for cr, pod in _pods(OperatorConfig())
        if cr.spec.model.source.startswith("hf://") and cr.spec.engine.backend == "builtin"
    ]
    assert pods, "an example serves hf:// weights with the builtin engine"
    for cr, pod in pods:
        (pull,) = pod["initContainers"]
        (engine,) = pod["containers"]
        assert pull["command"] == ["fleetllm", "model", "pull"]
        source, target = pull["args"]
        assert source == cr.spec.model.source
        assert _arg(engine, "--model") == target  # the engine loads what was pulled
        assert pull["image"] == built_image(pull["image"]).reference  # type: ignore[union-attr]
        # Credentials reach the pull as they reach the engine.
        assert [e for e in pull["env"] if e["name"] == "HF_TOKEN"] == [
            e for e in engine["env"] if e["name"] == "HF_TOKEN"
        ]
        volumes = {v["name"]: v for v in pod["volumes"]}
        models = volumes["models"]["emptyDir"]["sizeLimit"]
        request = engine["resources"]["requests"]["ephemeral-storage"]
        weights_gib = plan(cr.spec).total_weights_bytes / 2**30
        assert int(models.removesuffix("Gi")) > weights_gib
        # The request covers every emptyDir on the node's disk, the download among them.
        disk = sum(
            int(v["emptyDir"]["sizeLimit"].removesuffix("Gi"))
            for v in pod["volumes"]
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
        )
        assert int(request.removesuffix("Gi")) == disk
        assert {"name": "models", "mountPath": target.split("/hf/")[0]} in pull["volumeMounts"]
        assert {
            "name": "models",
            "mountPath": target.split("/hf/")[0],
            "readOnly": True,
        } in engine["volumeMounts"]


def test_a_shared_model_cache_replaces_the_per_pod_download() -> None:
    config = OperatorConfig(model_cache=ModelCache("model-cache"))
    for cr, pod in _pods(config):
        if not plan(cr.spec).fills_cache:
            assert "initContainers" not in pod
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"] == {
            "name": "models",
            "persistentVolumeClaim": {"claimName": "model-cache"},
        }
        (pull,) = pod["initContainers"]
        (mount,) = [m for m in pull["volumeMounts"] if m["name"] == "models"]
        assert "readOnly" not in mount  # it fills the cache
        # The download no longer takes node disk.
        (engine,) = pod["containers"]
        assert engine["resources"]["requests"]["ephemeral-storage"] == "3Gi"


def test_the_deadline_covers_the_download_and_the_startup_probe_the_load() -> None:
    deadlines = {}
    for name, spec in (("hf", _spec()), ("pvc", _spec(model=PVC_LLAMA))):
        objects = render(_cr(name, spec), plan(spec))
        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        load = probe["periodSeconds"] * probe["failureThreshold"]
        deadlines[name] = (deployment["spec"]["progressDeadlineSeconds"], load)
    # Same weights, same load budget; the download adds 20 s per GiB to the deadline.
    assert deadlines["hf"][1] == deadlines["pvc"][1]
    assert deadlines["hf"][0] - deadlines["pvc"][0] >= 20 * 15


@pytest.mark.parametrize(
    ("modes", "replicas", "refused"),
    [
        (["ReadWriteOnce"], 2, True),
        (["ReadWriteOnce"], 1, False),
        (["ReadOnlyMany"], 4, False),
        (["ReadWriteMany"], 4, False),
        (["ReadWriteOncePod"], 1, True),
    ],
)
def test_a_pvc_source_the_replicas_cannot_share_is_refused_with_a_reason(
    modes: list[str], replicas: int, refused: bool
) -> None:
    spec = _spec(model=PVC_LLAMA, replicas=replicas)
    if not refused:
        plan(spec, claim_access_modes={"store": modes})
        return
    with pytest.raises(PlanError) as info:
        plan(spec, claim_access_modes={"store": modes})
    assert info.value.reason == "ClaimNotShareable"
    assert "store" in info.value.message and modes[0] in info.value.message
    # Autoscaling up to several replicas counts too.
    if replicas == 1 and modes == ["ReadWriteOnce"]:
        scaled = _spec(model=PVC_LLAMA, scaling={"minReplicas": 1, "maxReplicas": 3})
        with pytest.raises(PlanError, match="up to 3 replicas"):
            plan(scaled, claim_access_modes={"store": modes})


def test_a_model_cache_every_replica_writes_must_be_read_write_many() -> None:
    spec = _spec(replicas=2)
    rwx = OperatorConfig(model_cache=ModelCache("cache"))
    with pytest.raises(PlanError, match="needs ReadWriteMany"):
        plan(spec, rwx, {"cache": ["ReadOnlyMany"]})
    plan(spec, rwx, {"cache": ["ReadWriteMany"]})
    filled = OperatorConfig(model_cache=ModelCache("cache", read_only=True))
    plan(spec, filled, {"cache": ["ReadOnlyMany"]})


# `vllm serve`'s flags: the table read from the tested release's own parser.
VLLM_SERVE_FLAGS = set(vllm_flags().by_flag)
VLLM_QUANTIZATION = {"awq_marlin", "gptq_marlin", "awq", "gptq", "compressed-tensors", "fp8"}


def test_vllm_pods_run_vllm_serve_with_flags_the_tested_release_has() -> None:
    seen = 0
    for config in CONFIGS:
        for cr, pod in _pods(config):
            (engine,) = pod["containers"]
            if cr.spec.engine.backend != "vllm":
                continue
            seen += 1
            assert engine["image"] == (VLLM_IMAGE if plan(cr.spec).gpu.is_gpu else VLLM_CPU_IMAGE)
            assert engine["command"] == ["vllm", "serve"]
            model, *flags = engine["args"]
            assert model.startswith("/")  # a folder in the pod, positional
            assert {f for f in flags if f.startswith("-")} <= VLLM_SERVE_FLAGS
            if "--quantization" in flags:
                assert _arg(engine, "--quantization") in VLLM_QUANTIZATION
            assert _arg(engine, "--shutdown-timeout") == str(cr.spec.engine.drain_seconds)
            grace = pod["terminationGracePeriodSeconds"]
            assert grace > 10 + cr.spec.engine.drain_seconds
    assert seen >= 4
