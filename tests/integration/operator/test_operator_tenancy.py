"""The operator against an emulated API server, for what keeps tenants in their lane: the
admin's policy refuses fields with a condition naming field and rule, engine.env reads only
Secrets the admin labelled, each LLMDeployment gets a key Secret (made once; or, with the fleet's
root, the derived key, rewritten when the root rotates) and a NetworkPolicy the resync restores,
and an update made during a ten-minute API outage is applied after it: by the reconcile loop,
and by the whole operator (kopf's watches and handlers included) on a fast clock."""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from deployment_manifests import smollm2
from kubeapi import KMOCK_WARNINGS, EmulatedApiServer
from kubelogin import kubeconfig_for
from operator_testkit import CR, CRS, DEPLOYMENTS, merge_patch

from fleetllm.api.contract import engine_key
from fleetllm.kube.client import KubeClient
from fleetllm.kube.login import load_credentials
from fleetllm.operator.handlers import make_settings
from fleetllm.operator.reconciler import Reconciler
from fleetllm.operator.retry import Backoff, reconcile_until_done

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

SECRETS = "v1/secrets"
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
AGENT = "fleetllm-operator-test"

SMOL = smollm2("smol", "default", maxModelLen=4096)


@pytest_asyncio.fixture()
async def reconciler(api: EmulatedApiServer, tmp_path: Path) -> AsyncIterator[Reconciler]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_for(str(api.url).rstrip("/")))
    client = KubeClient(
        functools.partial(load_credentials, kubeconfig=kubeconfig), user_agent=AGENT
    )

    async def no_events(*_: Any) -> None:
        return None

    yield Reconciler(client, emit=no_events)
    await client.close()


async def _create(api: Any, body: dict[str, Any]) -> None:
    async with api.post(CRS, json=body) as response:
        assert response.status in (200, 201), await response.text()


def _condition(api: Any, name: str, ctype: str) -> dict[str, Any]:
    conditions = (api.get(CR, name).get("status") or {}).get("conditions", [])
    return next(c for c in conditions if c["type"] == ctype)


def _arg(deployment: dict[str, Any], flag: str) -> str:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


def _with(spec: dict[str, Any], name: str = "smol") -> dict[str, Any]:
    body = copy.deepcopy(SMOL)
    body["metadata"]["name"] = name
    body["spec"] |= spec
    return body


async def test_a_refused_field_sets_a_condition_naming_field_and_rule(
    api: EmulatedApiServer, reconciler: Reconciler
) -> None:
    await _create(
        api,
        _with(
            {
                "engine": {"env": [{"name": "LD_PRELOAD", "value": "/models/x/evil.json"}]},
                "pod": {"serviceAccountName": "cloud-admin"},
            }
        ),
    )
    outcome = await reconciler.reconcile("default", "smol")
    assert outcome is not None and not outcome.planned and outcome.applied == []
    planned = _condition(api, "smol", "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "PolicyViolation")
    assert (
        "spec.engine.env[0].name: LD_PRELOAD matches 'LD_*' (policy env.denied)"
        in (planned["message"])
    )
    assert (
        "spec.pod.serviceAccountName: cloud-admin is not allowed (policy " in (planned["message"])
    )
    assert api.get(DEPLOYMENTS, "smol-engine") is None  # nothing of it runs


async def test_engine_env_reads_only_secrets_the_admin_labelled(
    api: EmulatedApiServer, reconciler: Reconciler
) -> None:
    ref = {"secretKeyRef": {"name": "hf", "key": "token"}}
    await _create(api, _with({"engine": {"env": [{"name": "HF_TOKEN", "valueFrom": ref}]}}))
    # Missing, then unlabelled: refused, naming the field.
    for labels in (None, {"app": "other"}):
        if labels is not None:
            secret = {"metadata": {"name": "hf", "labels": labels}, "data": {"token": "eA=="}}
            async with api.post("/api/v1/namespaces/default/secrets", json=secret) as response:
                assert response.status in (200, 201)
        await reconciler.reconcile("default", "smol")
        planned = _condition(api, "smol", "Planned")
        assert planned["reason"] == "PolicyViolation", planned
        assert "spec.engine.env[0].valueFrom.secretKeyRef: Secret hf" in planned["message"]
        assert api.get(DEPLOYMENTS, "smol-engine") is None
    # The admin labels it: applied.
    await merge_patch(
        api,
        "/api/v1/namespaces/default/secrets/hf",
        {"metadata": {"labels": {"fleetllm.io/engine-env": "true"}}},
    )
    await reconciler.reconcile("default", "smol")
    status = api.get(CR, "smol")["status"]
    assert status["observedGeneration"] == api.get(CR, "smol")["metadata"]["generation"]
    assert api.get(DEPLOYMENTS, "smol-engine") is not None


async def test_the_key_secret_is_made_once_and_owned(
    api: EmulatedApiServer, reconciler: Reconciler
) -> None:
    await _create(api, SMOL)
    await reconciler.reconcile("default", "smol")
    secret = api.get(SECRETS, "smol-engine-key")
    assert secret is not None
    uid = api.get(CR, "smol")["metadata"]["uid"]
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [uid]
    key = secret.get("stringData", secret.get("data"))
    # Later reconciles (a spec change included) never write it again: the key stays.
    writes = len(api.writes())
    await merge_patch(api, f"{CRS}/smol", {"spec": {"maxModelLen": 2048}})
    await reconciler.reconcile("default", "smol")
    assert not [w for w in api.writes()[writes:] if "secrets" in str(w.url)]
    again = api.get(SECRETS, "smol-engine-key")
    assert again.get("stringData", again.get("data")) == key
    assert api.get(NETWORKPOLICIES, "smol-engine") is not None


async def test_with_a_root_the_key_is_derived_and_follows_a_rotation(
    api: EmulatedApiServer, reconciler: Reconciler
) -> None:
    await _create(api, SMOL)
    uid = api.get(CR, "smol")["metadata"]["uid"]
    for root in ("first-root", "rotated-root"):
        derived = Reconciler(reconciler.client, emit=reconciler.emit, engine_key_root=root)
        outcome = await derived.reconcile("default", "smol")
        assert outcome is not None and outcome.planned
        data = api.get(SECRETS, "smol-engine-key")["data"]["api-key"]
        assert base64.b64decode(data).decode() == engine_key(root, "default", "smol", uid)
        # Once written, a reconcile with the same root leaves it alone.
        writes = len(api.writes())
        await derived.reconcile("default", "smol")
        assert not [w for w in api.writes()[writes:] if "secrets" in str(w.url)]


async def test_an_update_made_during_a_ten_minute_outage_is_applied_after_it(
    api: EmulatedApiServer, reconciler: Reconciler
) -> None:
    await _create(api, SMOL)
    await reconciler.reconcile("default", "smol")
    assert _arg(api.get(DEPLOYMENTS, "smol-engine"), "--max-model-len") == "4096"

    api.outage_agents = (AGENT,)
    clock = 0.0
    delays: list[float] = []

    async def virtual_sleep(seconds: float) -> None:
        nonlocal clock
        delays.append(seconds)
        if clock < 60 <= clock + seconds:
            # A minute into the outage, someone updates the LLMDeployment.
            await merge_patch(api, f"{CRS}/smol", {"spec": {"maxModelLen": 2048}})
        clock += seconds
        if clock >= 600:
            api.outage_agents = ()

    backoff = Backoff(first_seconds=1.0, max_seconds=30.0)
    outcome = await reconcile_until_done(reconciler, "default", "smol", backoff, virtual_sleep)
    assert outcome is not None and outcome.planned
    assert clock >= 600  # it kept trying through the whole outage...
    assert max(delays) == 30.0  # ...each wait capped
    assert len(delays) > 10  # (kopf's former limit gave up after 10)
    assert _arg(api.get(DEPLOYMENTS, "smol-engine"), "--max-model-len") == "2048"


async def test_the_resync_restores_an_unwatched_child(
    api: EmulatedApiServer, start_operator: Any, eventually: Any
) -> None:
    await start_operator(resync_interval=0.5)
    await _create(api, SMOL)
    await eventually(lambda: api.get(NETWORKPOLICIES, "smol-engine"), "NetworkPolicy made")
    async with api.delete(
        "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/smol-engine"
    ) as response:
        assert response.status == 200
    # No watch covers NetworkPolicies: only the periodic resync brings it back.
    await eventually(lambda: api.get(NETWORKPOLICIES, "smol-engine"), "NetworkPolicy restored")


async def test_the_operator_waits_out_a_ten_minute_outage_and_applies_the_update_after_it(
    api: EmulatedApiServer, start_operator: Any, eventually: Any
) -> None:
    # The production settings; the operator's clock runs 40 times faster than the wall's,
    # so the ten minutes (kopf's retries, watch timeouts, resyncs, backoffs) take fifteen
    # seconds. The test's clock (and the API server's) is the wall's.
    rate = 40.0
    settings = make_settings(standalone=True)
    settings.scanning.disabled = True  # kmock cannot list namespaces
    operator = await start_operator(settings=settings, clock_rate=rate)
    await _create(api, SMOL)
    await eventually(lambda: api.get(DEPLOYMENTS, "smol-engine"), "the engine Deployment")

    # Every request of the operator's (kopf's watches and patches, the reconciler's calls)
    # gets 503 for ten minutes; a minute in, someone updates the LLMDeployment.
    agents = ("kopf", "fleetllm-operator")
    api.outage_agents = agents

    def tries() -> int:
        return sum(1 for agent, _ in api.authorizations if agent.startswith(agents))

    await asyncio.sleep(60 / rate)
    await merge_patch(api, f"{CRS}/smol", {"spec": {"maxModelLen": 2048}})
    await asyncio.sleep(480 / rate)
    before_last_minute = tries()
    await asyncio.sleep(60 / rate)
    api.outage_agents = ()
    assert tries() > before_last_minute  # still trying at the end of the outage
    assert operator.failure is None

    await eventually(
        lambda: _arg(api.get(DEPLOYMENTS, "smol-engine"), "--max-model-len") == "2048",
        "the update applied after the outage",
    )

    def reconciled() -> bool:
        cr = api.get(CR, "smol")
        return (cr.get("status") or {}).get("observedGeneration") == cr["metadata"]["generation"]

    await eventually(reconciled, "the status of the updated generation")
    assert operator.failure is None
