"""The install pages (deployment.md's GPU walkthrough, upgrade.md, troubleshooting.md): every
shell block has a runner; the ones that need no cluster run here, as written, and do what the
page says; the cluster ones are the e2e tier's (tests/e2e/test_cluster_gpu_walkthrough.py reads
them from the pages). Also what the pages promise of the manifests: CRDs first in
manifests/base, CRD upgrades that take over Helm's fields, and an L4 example that fits the
g2-standard-4 node the walkthrough names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from docblocks import DOCS, ROOT, blocks, run_by
from helmchart import pod_images

from fleetllm.api.manifests import load_llmdeployments
from fleetllm.operator.admission import review
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.policy.check import secret_refusal
from fleetllm.policy.model import Policy

PAGES = ("deployment.md", "upgrade.md", "troubleshooting.md")
HERE = "tests/unit/test_docs_install.py"
E2E = "tests/e2e"
# What the commands reach, relative to the repository root (the run happens in a scratch
# folder, so that the files they write stay out of the checkout).
LINKED = (".venv", "charts", "crds", "docker", "manifests", "scripts")
# A g2-standard-4: 4 vCPUs, 16 GiB (Compute Engine's "GB" of memory are GiB), one L4.
G2_STANDARD_4 = {"cpu": 4.0, "memory_gib": 16.0}
# What the kernel keeps of a VM's memory before the kubelet sees it (its capacity).
KERNEL_GIB = 0.5
# GKE's system daemons on a GPU node (kube-proxy, logging, metrics, the GPU device plugin,
# the disk driver, the metadata server): their requests, generously.
DAEMONS = {"cpu": 0.5, "memory_gib": 0.5}


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("page", PAGES)
def test_every_shell_block_of_the_install_pages_has_a_runner(page: str) -> None:
    shell = [b for b in blocks(page) if b.lang in ("bash", "shell", "sh")]
    assert shell, page
    for block in shell:
        assert block.note in (f"run by: {HERE}", f"run by: {E2E}"), (page, block.body)
    e2e = (ROOT / E2E / "test_cluster_gpu_walkthrough.py").read_text()
    if run_by(page, E2E):
        assert f'"{page}"' in e2e, page


@pytest.fixture()
def scratch(tmp_path: Path) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _run_page(page: str, scratch: Path) -> None:
    script = "\n".join(["set -euo pipefail", *(b.body for b in run_by(page, HERE))])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-c", script], cwd=scratch, env=env, capture_output=True, text=True,
        check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (scratch / "stdout.txt").write_text(result.stdout)


def test_the_walkthroughs_offline_checks_run_and_use_the_users_registry(scratch: Path) -> None:
    _run_page("deployment.md", scratch)
    registry = "us-docker.pkg.dev/my-project/fleetllm"
    out = (scratch / "stdout.txt").read_text()
    tags = [line.split("--tag ")[1].split()[0] for line in out.splitlines() if "--tag " in line]
    assert len(tags) == 4 and all(t.startswith(f"{registry}/") for t in tags)
    assert "llama-3b-l4" in out and "L4" in out  # the plan
    chart = pod_images(_documents(scratch / "fleetllm.yaml"))
    engine = pod_images(_documents(scratch / "llama-3b-l4.yaml"))
    assert chart and engine
    assert {i for i in chart | engine if not i.startswith(f"{registry}/")} == set()
    # What the build pushes is what the chart and the operator pull.
    assert engine <= set(tags) and chart <= set(tags)


def test_the_upgrade_pages_offline_diff_leaves_the_engine_pods_alone(scratch: Path) -> None:
    _run_page("upgrade.md", scratch)
    before = _documents(scratch / "before.yaml")
    after = _documents(scratch / "after.yaml")
    # Only the control plane's image moves: the operator's flags (the engine images among
    # them) are the same, so it renders the same engine pods.
    assert {i.rsplit(":", 1)[1] for i in pod_images(before)} == {"0.0.9"}

    def operator_args(objects: list[dict]) -> list[str]:
        (deployment,) = [
            o
            for o in objects
            if o["kind"] == "Deployment" and o["metadata"]["name"] == "fleetllm-operator"
        ]
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    assert operator_args(before) == operator_args(after)
    assert _documents(scratch / "engine-pods.yaml")


def _all_commands() -> list[tuple[str, list[str]]]:
    """(where, commands) of every code block of the docs and the README, and the chart's
    install notes (one block)."""
    found = [(page.name, b.commands) for page in DOCS.glob("*.md") for b in blocks(page)]
    found += [("README.md", b.commands) for b in blocks(ROOT / "README.md")]
    notes = ROOT / "charts" / "fleetllm" / "templates" / "NOTES.txt"
    found.append(("NOTES.txt", [line.strip() for line in notes.read_text().splitlines()]))
    return found


def test_crd_upgrades_take_over_helms_fields_and_nothing_advises_reuse_values() -> None:
    checked = 0
    for where, commands in _all_commands():
        for i, command in enumerate(commands):
            assert "--reuse-values" not in command, (where, command)
            if "kubectl apply" in command and "crds" in command:
                assert "--server-side --force-conflicts" in command, (where, command)
                checked += 1
            # One apply cannot make a CRD and an object of its kind (the peering object):
            # manifests/base only once its CRDs are established, in the same block.
            if "-k manifests/base" in command:
                assert any("condition=established" in c for c in commands[:i]), (where, command)
    assert checked >= 2


def test_manifests_base_puts_the_crds_before_every_object_of_their_kinds() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kubectl"), "kustomize", str(ROOT / "manifests/base")],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = [o["kind"] for o in objects]
    crds = [i for i, kind in enumerate(kinds) if kind == "CustomResourceDefinition"]
    assert len(crds) == 3
    # Only the Namespace may come before the CRDs; custom objects only after them.
    assert set(kinds[: crds[0]]) <= {"Namespace"}
    assert crds == list(range(crds[0], crds[0] + len(crds)))
    defined = {
        (o["spec"]["group"], o["spec"]["names"]["kind"])
        for o in objects
        if o["kind"] == "CustomResourceDefinition"
    }
    custom = [
        i for i, o in enumerate(objects) if (o["apiVersion"].split("/")[0], o["kind"]) in defined
    ]
    assert custom and min(custom) > max(crds)


def _gke_reserved_cpu(cores: float) -> float:
    """GKE's kube-reserved CPU: 6% of the first core, 1% of the next, 0.5% of the next two,
    0.25% of the rest."""
    shares = ((1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025))
    reserved, left = 0.0, cores
    for size, share in shares:
        reserved += min(left, size) * share
        left -= min(left, size)
    return reserved


def _gke_reserved_memory_gib(gib: float) -> float:
    """GKE's kube-reserved memory (25% of the first 4 GiB, 20% of the next 4, 10% of the next
    8, 6% of the next 112, 2% above) plus its 100 MiB eviction threshold."""
    shares = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02))
    reserved, left = 0.0, gib
    for size, share in shares:
        reserved += min(left, size) * share
        left -= min(left, size)
    return reserved + 100 / 1024


def _quantity(value: str) -> float:
    """CPUs, or GiB for a memory quantity."""
    units = {"Mi": 1 / 1024, "Gi": 1.0, "m": 1 / 1000}
    for suffix, scale in units.items():
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * scale
    return float(value)


def test_the_l4_example_fits_a_g2_standard_4() -> None:
    """The pod's effective request (the larger of its init container and its containers) fits
    what GKE leaves allocatable on the node the walkthrough names, after its daemons; its
    memory limit too, so that a replica at its limit never pushes the node into eviction."""
    cpu = G2_STANDARD_4["cpu"] - _gke_reserved_cpu(G2_STANDARD_4["cpu"]) - DAEMONS["cpu"]
    capacity = G2_STANDARD_4["memory_gib"] - KERNEL_GIB
    memory = (
        capacity - _gke_reserved_memory_gib(G2_STANDARD_4["memory_gib"]) - DAEMONS["memory_gib"]
    )
    assert (round(cpu, 2), round(memory, 1)) == (3.42, 12.3)  # the arithmetic, spelled out

    (cr,) = load_llmdeployments(ROOT / "manifests" / "examples" / "llama-3.2-3b-l4-gke.yaml")
    objects = render(cr, plan(cr.spec))
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2  # one node each: a g2-standard-4 has one L4
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    for resource, free in (("cpu", cpu), ("memory", memory)):
        init = max(_quantity(c["resources"]["requests"][resource]) for c in pod["initContainers"])
        effective = max(init, _quantity(engine["resources"]["requests"][resource]))
        assert effective <= free, (resource, effective, free)
    assert _quantity(engine["resources"]["limits"]["memory"]) <= memory
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "1"
    # The download's disk: far below what a default 100 GB boot disk leaves allocatable.
    assert _quantity(engine["resources"]["requests"]["ephemeral-storage"]) <= 50


def test_the_walkthroughs_hub_token_secret_passes_the_charts_policy() -> None:
    """The example's engine reads HF_TOKEN from a Secret: the operator refuses it unless the
    Secret carries the policy's label, so the walkthrough labels it before applying."""
    commands = [c for b in run_by("deployment.md", E2E) for c in b.commands]
    (create,) = [i for i, c in enumerate(commands) if "create secret generic huggingface" in c]
    (label,) = [i for i, c in enumerate(commands) if "label secret huggingface" in c]
    (apply,) = [i for i, c in enumerate(commands) if "apply -f manifests/examples/" in c]
    assert create < label < apply
    labels = dict(pair.split("=", 1) for pair in commands[label].split()[4:])
    policy = Policy.model_validate(
        yaml.safe_load((ROOT / "charts" / "fleetllm" / "values.yaml").read_text())["policy"]
    )
    (cr,) = load_llmdeployments(ROOT / "manifests" / "examples" / "llama-3.2-3b-l4-gke.yaml")
    # The Secrets the operator reads the labels of before it applies anything.
    report = review(cr, plan(cr.spec), OperatorConfig(policy=policy))
    assert report.violations == [] and [ref.name for ref in report.secrets] == ["huggingface"]
    for ref in report.secrets:
        assert secret_refusal(ref, labels, policy) is None
        assert secret_refusal(ref, {}, policy) is not None  # unlabelled: refused


def test_the_troubleshooting_pages_offline_checks_show_the_pods_so_configured(
    scratch: Path,
) -> None:
    _run_page("troubleshooting.md", scratch)
    rendered = _documents(scratch / "rendered.yaml")
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    images = pod_images(rendered)
    assert images and {i for i in images if not i.startswith("registry.example.com/mirror/")} == (
        set()
    )
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-l4"
    assert "llama-3b-l4" in (scratch / "stdout.txt").read_text()


CONDITIONS = ("Planned", "Progressing", "Ready", "Degraded", "ScaledToZero")


def _status_reasons() -> dict[tuple[str, str], set[str]]:
    """(condition, status) -> each reason operator/status.py sets (its literal tuples)."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for node in ast.walk(ast.parse((ROOT / "operator" / "status.py").read_text())):
        if isinstance(node, ast.Tuple) and len(node.elts) == 4:
            head = [e.value if isinstance(e, ast.Constant) else None for e in node.elts[:3]]
            if head[0] in CONDITIONS and isinstance(head[1], str) and isinstance(head[2], str):
                found[head[0], head[1]].add(head[2])
    return found


def _literal_reasons(call: str) -> set[str]:
    """The reason (first argument) of every `call(...)` with a literal one in the code."""
    found = set()
    for path in [*(ROOT / "fleetllm").rglob("*.py"), *(ROOT / "operator").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == call
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    return found


def _table_reasons(page: str, first: str) -> dict[str, str]:
    """First cell -> second cell of each row of the page's table whose header starts so."""
    text = (DOCS / page).read_text()
    table = text[text.index(f"| {first} |") :].split("\n\n", 1)[0].splitlines()[2:]
    return {row.split(" | ")[0].strip("| `"): row.split(" | ")[1] for row in table}


def test_the_troubleshooting_table_names_every_condition_reason_the_operator_sets() -> None:
    code = _status_reasons()
    assert {c for c, _ in code} == set(CONDITIONS)
    table = _table_reasons("troubleshooting.md", "condition")
    assert list(table) == list(CONDITIONS)
    refusals = _literal_reasons("PlanError") | _literal_reasons("Refusal")
    for condition, cell in table.items():
        for part in cell.split(";"):
            status, _, names = part.strip().partition(": ")
            named = set(re.findall(r"`([A-Z][A-Za-z]+)`", names))
            if (condition, status) == ("Planned", "False"):
                # The refusals: planner.md's table lists them all (below).
                assert named <= refusals and {"PolicyViolation", "InvalidSpec"} <= named
                continue
            assert named == code.pop((condition, status)), (condition, status)
    assert set(code) == set(), "conditions the table does not list"


def test_the_planners_refusal_table_lists_every_reason_it_refuses_with() -> None:
    listed = {
        name
        for cell in _table_reasons("planner.md", "reason")
        for name in re.findall(r"[A-Z][A-Za-z]+", cell)
    }
    assert listed == _literal_reasons("PlanError")


def test_the_cuda_images_driver_note_names_the_torch_it_installs() -> None:
    """deployment.md says which driver the CUDA image needs from the torch it pins."""
    dockerfile = (ROOT / "docker" / "engine-cuda.Dockerfile").read_text()
    (pin,) = re.findall(r"\btorch==(\S+)", dockerfile)
    (named,) = re.findall(r"Its torch \((\S+)\s+from PyPI\)", (DOCS / "deployment.md").read_text())
    assert named == pin
