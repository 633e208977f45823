"""docs/deployment.md's GPU walkthrough, docs/upgrade.md and docs/troubleshooting.md on the
cluster the tier runs on (runs only with KUBECONFIG).

The session's control plane is installed by the quickstart (conftest.py), from the images
loaded into the cluster. On it, the walkthrough's model steps run as written in a fresh
namespace ($HF_TOKEN a placeholder where none is given): the gated model's Secret, the L4
example, and, where the cluster has an L4 (FLEETLLM_E2E_GPU=1, with a real token), the wait
for Ready and a request. Without GPUs the example must be planned and its pods Pending for
want of `nvidia.com/gpu`, as docs/troubleshooting.md says they show. The upgrade page's CRD
commands run as written (the CRDs exist: the apply takes over Helm's fields)."""

from __future__ import annotations

import os

from docblocks import run_by
from e2e_cluster import condition, get_json, kubectl, needs_cluster, run, wait_for

pytestmark = needs_cluster
ON_GPUS = os.environ.get("FLEETLLM_E2E_GPU") == "1"
# The walkthrough's steps that install the control plane and push images; the quickstart did
# the one, the tier's images are loaded (not pushed) for the other.
INSTALL_STEPS = (
    "scripts/build-images.sh",
    ".venv/bin/helm install",
    "create secret generic fleetllm-router-keys",
)


def _commands(page: str) -> list[str]:
    return [c for b in run_by(page, "tests/e2e") for c in b.commands]


def test_the_walkthrough_pages_have_cluster_steps() -> None:
    walkthrough = _commands("deployment.md")
    assert any(c.startswith(INSTALL_STEPS[1]) and "global.imageRegistry" in c for c in walkthrough)
    assert any("create secret generic huggingface" in c for c in walkthrough)
    assert _commands("upgrade.md") and _commands("troubleshooting.md")


def test_the_upgrade_pages_crd_commands_apply_over_helms(quickstart: object) -> None:
    for command in _commands("upgrade.md"):
        if "crds" in command and "manifests/base" not in command:
            run("bash", "-c", command, timeout=300)


def test_the_walkthroughs_model_steps_run_as_written(quickstart: object, namespace: str) -> None:
    token = os.environ.get("HF_TOKEN", "hf_placeholder")
    for command in _commands("deployment.md"):
        if any(step in command for step in INSTALL_STEPS) or command.startswith("curl "):
            continue
        if command.endswith("&"):
            continue  # the port-forward: the quickstart's reaches the same router
        if "kubectl wait" in command and not ON_GPUS:
            continue
        kubectl_args = command.split(".venv/bin/kubectl ", 1)[1]
        script = f"export HF_TOKEN={token}; .venv/bin/kubectl -n {namespace} {kubectl_args}"
        run("bash", "-c", script, timeout=2400)
    assert kubectl("get", "secret", "huggingface", "-n", namespace, "-o", "name")
    llmd = get_json("llmdeployment", "llama-3b-l4", "-n", namespace)
    if ON_GPUS:
        assert condition(llmd, "Ready")["status"] == "True"
        return
    wait_for(
        lambda: (
            (
                condition(get_json("llmdeployment", "llama-3b-l4", "-n", namespace), "Planned")
                or {}
            ).get("status")
            == "True"
        ),
        "the L4 example planned",
    )

    def unschedulable() -> bool:
        events = kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=FailedScheduling"
        )
        return "nvidia.com/gpu" in events

    wait_for(unschedulable, "a FailedScheduling Event naming nvidia.com/gpu", timeout=180)
    for command in _commands("troubleshooting.md"):
        run("bash", "-c", command, timeout=120)
