"""docs/deployment.md's GPU walkthrough, docs/upgrade.md and docs/troubleshooting.md on the
cluster the tier runs on (runs only with KUBECONFIG).

The session's control plane is installed by the quickstart (conftest.py), from the images
loaded into the cluster, with its API key and its port-forward of the router to 8080. On it,
the walkthrough's model steps run as written in a fresh namespace ($HF_TOKEN a placeholder
where none is given): the gated model's labelled Secret, the L4 example, and, where the
cluster has an L4 (FLEETLLM_E2E_GPU=1, with a real token), the wait for Ready and the request
through the router. Without GPUs the example must be planned (the Secret passes the chart's
policy) and its pods Pending for want of `nvidia.com/gpu`, as docs/troubleshooting.md says
they show. The upgrade page's commands run as written on the quickstart's release: the CRDs
taken over from Helm, the values kept in a file, `helm upgrade`; then the operator restarts
(as a new version does) and the quickstart's model keeps its pods."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from docblocks import run_by
from e2e_cluster import (
    KEY,
    ROOT,
    SYSTEM,
    condition,
    get_json,
    kubectl,
    needs_cluster,
    run,
    tool,
    wait_for,
)

pytestmark = needs_cluster
ON_GPUS = os.environ.get("FLEETLLM_E2E_GPU") == "1"
# The walkthrough's steps that install the control plane, push images and make its key; the
# quickstart did the one (with the key KEY), the tier's images are loaded (not pushed).
INSTALL_STEPS = (
    "scripts/build-images.sh",
    ".venv/bin/helm install",
    "export KEY=",
    "create secret generic fleetllm-router-keys",
)
# What the upgrade page's commands reach, linked into the scratch folder they run in (so that
# the values file they write stays out of the checkout).
LINKED = (".venv", "charts", "crds", "manifests")


def _commands(page: str) -> list[str]:
    return [c for b in run_by(page, "tests/e2e") for c in b.commands]


def test_the_walkthrough_pages_have_cluster_steps() -> None:
    walkthrough = _commands("deployment.md")
    assert any(c.startswith(INSTALL_STEPS[1]) and "global.imageRegistry" in c for c in walkthrough)
    assert any("create secret generic huggingface" in c for c in walkthrough)
    assert any(c.startswith("curl ") for c in walkthrough)
    assert any(c.startswith(".venv/bin/helm upgrade") for c in _commands("upgrade.md"))
    assert _commands("troubleshooting.md")


def _engine_pods(namespace: str, name: str) -> set[str]:
    pods = get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    return {pod["metadata"]["uid"] for pod in pods["items"]}


def test_the_upgrade_page_upgrades_without_restarting_a_model(
    quickstart: object, tmp_path: Path
) -> None:
    engine = get_json("deployment", "smollm2-engine", "-n", "default")
    pods = _engine_pods("default", "smollm2")
    assert pods
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for command in _commands("upgrade.md"):
        if "-k manifests/base" in command:
            continue  # the chart's objects, without Helm: this cluster has them from Helm
        run("bash", "-c", command, timeout=600, cwd=tmp_path)
    assert (tmp_path / "my-values.yaml").read_text().strip()
    # A new operator version restarts the operator; it renders the same engine pods.
    kubectl("-n", SYSTEM, "rollout", "restart", "deployment/fleetllm-operator")
    run(
        tool("kubectl"), "-n", SYSTEM, "rollout", "status", "deployment/fleetllm-operator",
        "--timeout=300s", timeout=320,
    )  # fmt: skip
    # Time for the new leader to list and reconcile every LLMDeployment (it does at start).
    time.sleep(60)
    after = get_json("deployment", "smollm2-engine", "-n", "default")
    assert after["metadata"]["generation"] == engine["metadata"]["generation"]
    assert _engine_pods("default", "smollm2") == pods


def test_the_walkthroughs_model_steps_run_as_written(quickstart: object, namespace: str) -> None:
    variables = f"export HF_TOKEN={os.environ.get('HF_TOKEN', 'hf_placeholder')} KEY={KEY};"
    answers = []
    for command in _commands("deployment.md"):
        if any(step in command for step in INSTALL_STEPS) or command.endswith("&"):
            continue  # the quickstart installed the chart and forwards 8080 to its router
        if command.startswith("curl "):
            if ON_GPUS:
                answers.append(json.loads(run("bash", "-c", variables + command, timeout=300)))
            continue
        if "kubectl wait" in command and not ON_GPUS:
            continue
        kubectl_args = command.split(".venv/bin/kubectl ", 1)[1]
        script = f"{variables} .venv/bin/kubectl -n {namespace} {kubectl_args}"
        run("bash", "-c", script, timeout=2400)
    assert kubectl("get", "secret", "huggingface", "-n", namespace, "-o", "name")
    llmd = get_json("llmdeployment", "llama-3b-l4", "-n", namespace)
    if ON_GPUS:
        assert condition(llmd, "Ready")["status"] == "True"
        (answer,) = answers
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"]
        return
    wait_for(
        lambda: (
            (
                condition(get_json("llmdeployment", "llama-3b-l4", "-n", namespace), "Planned")
                or {}
            ).get("status")
            == "True"
        ),
        "the L4 example planned (its Secret labelled as the policy asks)",
    )

    def unschedulable() -> bool:
        events = kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=FailedScheduling"
        )
        return "nvidia.com/gpu" in events

    wait_for(unschedulable, "a FailedScheduling Event naming nvidia.com/gpu", timeout=180)
    for command in _commands("troubleshooting.md"):
        run("bash", "-c", command, timeout=120)
