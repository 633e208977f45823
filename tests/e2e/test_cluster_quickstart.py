"""docs/quickstart.md's cluster commands, run as written by the session's control plane
(conftest.py): they installed the chart, served the CPU example and got an answer through the
router. Runs only when KUBECONFIG is set (scripts/kind-e2e.sh)."""

from __future__ import annotations

import json

from e2e_cluster import SYSTEM, Quickstart, condition, get_json, needs_cluster

pytestmark = needs_cluster


def test_the_quickstart_installs_serves_and_answers(quickstart: Quickstart) -> None:
    (curl,) = [c for c in quickstart.commands if c.startswith("curl ")]
    answer = json.loads(quickstart.outputs[curl])
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"]

    llmd = get_json("llmdeployment", "smollm2", "-n", "default")
    assert condition(llmd, "Ready")["status"] == "True"
    assert llmd["status"]["readyReplicas"] == 1
    for name in ("fleetllm-operator", "fleetllm-router"):
        deployment = get_json("deployment", name, "-n", SYSTEM)
        assert deployment["status"]["readyReplicas"] == deployment["spec"]["replicas"] == 2
    (get,) = [c for c in quickstart.commands if c.endswith("kubectl get llmd")]
    assert "smollm2" in quickstart.outputs[get]
    (describe,) = [c for c in quickstart.commands if "describe llmd smollm2" in c]
    assert "Planned" in quickstart.outputs[describe]
