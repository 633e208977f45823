"""The operator never takes over an object it does not own, and kopf and the reconciler share
one login (an exec credential plugin here, renewed after a 401)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest
from kubeapi import KMOCK_WARNINGS
from kubelogin import ExecPlugin, kubeconfig_for
from operator_testkit import CR, CRS, smollm2_cr

from fleetllm.api.deployment import API_VERSION, KIND

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

CHILDREN = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "ConfigMap": "v1/configmaps",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
}
SMOL = smollm2_cr(replicas=1)


def _condition(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for cond in ((cr or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == ctype:
            return dict(cond)
    return {}


async def _send(
    api: Any, method: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> None:
    headers = dict(headers or {})
    if method == "PATCH":
        headers["Content-Type"] = "application/merge-patch+json"
    async with api.request(method, path, json=body, headers=headers) as response:
        assert response.status in (200, 201), await response.text()


FOREIGN: dict[str, tuple[str, dict[str, Any]]] = {
    # Someone's own Service, with no owner at all.
    "Service": (
        "/api/v1/namespaces/default/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "smol", "namespace": "default", "labels": {"team": "web"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ),
    # A ConfigMap controlled by another object (an earlier LLMDeployment named alike, say).
    "ConfigMap": (
        "/api/v1/namespaces/default/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "smol-engine",
                "namespace": "default",
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": KIND,
                        "name": "smol",
                        "uid": "0f0f0f0f-0000-0000-0000-000000000000",
                        "controller": True,
                    }
                ],
            },
            "data": {"theirs": "yes"},
        },
    ),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
async def test_an_object_it_does_not_own_is_left_untouched_and_reported(
    api: Any, start_operator: Any, eventually: Any, kind: str
) -> None:
    path, foreign = FOREIGN[kind]
    name = foreign["metadata"]["name"]
    await _send(api, "POST", path, foreign)
    before = api.get(CHILDREN[kind], name)
    await start_operator()
    await _send(api, "POST", CRS, SMOL)

    cr = await eventually(
        lambda: (c := api.get(CR, "smol")) and _condition(c, "Degraded").get("reason") == "Conflict"
        and c,
        "the Conflict condition",
    )  # fmt: skip
    degraded = _condition(cr, "Degraded")
    assert degraded["status"] == "True"
    assert f"{kind} {name}" in degraded["message"]
    assert "left untouched" in degraded["message"]
    progressing = _condition(cr, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "Conflict")
    assert _condition(cr, "Planned")["status"] == "True"  # the spec itself is fine
    await eventually(
        lambda: [
            e
            for e in api.list("v1/events")
            if e["reason"] == "Conflict"
            and e["type"] == "Warning"
            and e["involvedObject"]["name"] == "smol"
            and f"{kind} {name}" in e["message"]
        ],
        "a Conflict Event",
    )
    # Untouched: never written, and nothing else applied either.
    assert api.get(CHILDREN[kind], name) == before
    child_writes = [
        (r.method, r.url.path)
        for r in api.writes()
        if r.resource is not None and r.resource.plural not in ("llmdeployments", "events")
    ]
    assert child_writes == [("POST", path)]  # the test's own

    # The owner removes their object: the operator creates its children within the recheck.
    await _send(api, "DELETE", f"{path}/{name}", None)
    await eventually(lambda: all(api.get(p, n) for p, n in _child_names().items()), "children")
    mine = api.get(CHILDREN[kind], name)
    uid = api.get(CR, "smol")["metadata"]["uid"]
    assert [(r["uid"], r["controller"]) for r in mine["metadata"]["ownerReferences"]] == [
        (uid, True)
    ]
    await eventually(
        lambda: _condition(api.get(CR, "smol"), "Degraded").get("status") == "False",
        "the conflict cleared",
    )


def _child_names() -> dict[str, str]:
    return {
        CHILDREN["Deployment"]: "smol-engine",
        CHILDREN["Service"]: "smol",
        CHILDREN["ConfigMap"]: "smol-engine",
        CHILDREN["PodDisruptionBudget"]: "smol-engine",
    }


async def test_kopf_and_the_reconciler_share_the_exec_plugin_login(
    api: Any, start_operator: Any, eventually: Any, tmp_path: Path
) -> None:
    plugin = ExecPlugin(tmp_path / "plugin")
    plugin.issue("op-token-1")
    api.accept_tokens = {"op-token-1", "admin"}
    kubeconfig = tmp_path / "exec-kubeconfig"
    kubeconfig.write_text(kubeconfig_for(str(api.url).rstrip("/"), plugin.user))
    admin = {"Authorization": "Bearer admin"}  # the test's own requests

    await start_operator(kubeconfig=kubeconfig)
    await _send(api, "POST", CRS, SMOL, admin)
    await eventually(lambda: all(api.get(p, n) for p, n in _child_names().items()), "children")

    def tokens(agent: str) -> set[str]:
        return {auth for ua, auth in api.authorizations if ua.startswith(agent)}

    # kopf's watches and patches, and the reconciler's reads and applies, all carry the token
    # the plugin printed.
    assert tokens("kopf/") == {"Bearer op-token-1"}
    assert tokens("fleetllm-operator") == {"Bearer op-token-1"}
    # kopf watches the children through a server-side label selector.
    selectors = {
        r.resource.plural: r.params.get("labelSelector")
        for r in api
        if r.action == kmock.action.WATCH and r.resource is not None
    }
    for path in CHILDREN.values():
        assert selectors[path.rsplit("/", 1)[1]] == "app.kubernetes.io/managed-by=fleetllm"

    # The token is rotated: the next writes get 401, both log in again through the plugin.
    plugin.issue("op-token-2")
    api.accept_tokens = {"op-token-2", "admin"}
    await _send(api, "PATCH", f"{CRS}/smol", {"spec": {"maxModelLen": 2048}}, admin)

    def args() -> list[str]:
        deployment = api.get(CHILDREN["Deployment"], "smol-engine")
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    await eventually(lambda: "2048" in args(), "the Deployment follows the new spec")
    await eventually(lambda: "Bearer op-token-2" in tokens("kopf/"), "kopf logged in again")
    assert "Bearer op-token-2" in tokens("fleetllm-operator")
    assert plugin.runs >= 2
