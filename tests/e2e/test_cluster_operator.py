"""The operator against a real cluster (kind, k3d, ...): runs only when KUBECONFIG is set.

It installs the CRD, runs `fleetllm operator run` on a fresh namespace, applies the CPU
example and an unplannable LLMDeployment, and checks what the operator wrote. Engine images
need not be pullable: the test reads the objects, not the pods.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG") or KUBECTL is None,
    reason="needs a real cluster: set KUBECONFIG and put kubectl on PATH",
)


def kubectl(*args: str, stdin: str | None = None) -> str:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, *args], input=stdin, capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json"))


def wait_for(predicate, what: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}")


def condition(obj: dict, kind: str) -> dict | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == kind:
            return cond
    return None


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    ns = f"fleetllm-e2e-{uuid.uuid4().hex[:8]}"
    kubectl("apply", "-f", str(ROOT / "crds" / "fleetllm.io_llmdeployments.yaml"))
    kubectl("create", "namespace", ns)
    operator = subprocess.Popen(
        [sys.executable, "-m", "fleetllm.cli", "operator", "run", "-n", ns, "--standalone"],
        cwd=ROOT,
    )
    try:
        yield ns
    finally:
        operator.terminate()
        operator.wait(timeout=30)
        kubectl("delete", "namespace", ns, "--wait=false")


def test_example_gets_a_plan_and_its_children(namespace: str) -> None:
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "smollm2-cpu.yaml").read_text())
    name = example["metadata"]["name"]
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(example))

    def planned() -> dict | None:
        obj = get_json("llmdeployment", name, "-n", namespace)
        cond = condition(obj, "Planned")
        return obj if cond and cond["status"] == "True" else None

    obj = wait_for(planned, "Planned=True")
    assert obj["status"]["plan"]["maxConcurrentTokens"] > 0
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    uid = obj["metadata"]["uid"]
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        child = get_json(kind, "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
        assert child["items"], f"no {kind} for {name}"
        for item in child["items"]:
            owners = item["metadata"].get("ownerReferences", [])
            assert any(o["uid"] == uid for o in owners), f"{kind} lacks its ownerReference"

    # A deleted child comes back.
    kubectl("delete", "service", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    wait_for(
        lambda: get_json("service", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")[
            "items"
        ],
        "the Service to be recreated",
    )


def test_unplannable_deployment_is_refused_with_a_reason(namespace: str) -> None:
    doc = {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "too-big"},
        "spec": {
            "model": {"name": "llama-70b", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "gpu": {"type": "L4"},
            "maxModelLen": 8192,
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))

    def refused() -> dict | None:
        cond = condition(get_json("llmdeployment", "too-big", "-n", namespace), "Planned")
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(refused, "Planned=False")
    assert cond["message"]
    children = get_json("deployment", "-n", namespace, "-l", "app.kubernetes.io/instance=too-big")
    assert children["items"] == []
