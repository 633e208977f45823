"""fleetllm.kube against the emulated API server (tests/kubeapi.py): logins (an exec
credential plugin, a service account in a cluster, renewal on expiry and after a 401), paged
lists, watches that resume from bookmarks, relist after 410 Gone and back off on errors, and
the write calls the operator, the router and the autoscaler use."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import trustme
from deployment_manifests import smollm2
from kubeapi import CR_RESOURCE, KMOCK_WARNINGS, EmulatedApiServer, emulated_api, eventually
from kubelogin import ExecPlugin, kubeconfig_for

from fleetllm.api.deployment import KIND, LLMDEPLOYMENTS
from fleetllm.kube import login
from fleetllm.kube.client import KubeClient
from fleetllm.kube.errors import ApiError
from fleetllm.kube.events import EVENT_MESSAGE_LIMIT
from fleetllm.kube.login import load_credentials
from fleetllm.kube.resources import CONFIGMAPS, DEPLOYMENTS
from fleetllm.kube.watch import Backoff, Resync, WatchEvent

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

NS = "default"
AGENT = "fleetllm-test"


@pytest_asyncio.fixture()
async def api() -> AsyncIterator[EmulatedApiServer]:
    async with emulated_api() as server:
        yield server


def _url(api: EmulatedApiServer) -> str:
    return str(api.url).rstrip("/")


def _client(api: EmulatedApiServer, tmp_path: Path, user: dict[str, Any] | None = None) -> Any:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_for(_url(api), user))
    return KubeClient(functools.partial(load_credentials, kubeconfig=kubeconfig), user_agent=AGENT)


def _ours(api: EmulatedApiServer) -> list[str]:
    """The Authorization headers of this client's requests, in order."""
    return [auth for agent, auth in api.authorizations if agent == AGENT]


def _configmap(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "data": {"k": name},
    }


# -- logins ----------------------------------------------------------------------------------


async def test_exec_plugin_token_reaches_the_server_and_is_renewed_after_401(
    api: EmulatedApiServer, tmp_path: Path
) -> None:
    plugin = ExecPlugin(tmp_path / "plugin")
    plugin.issue("eks-token-1")
    api.accept_tokens = {"eks-token-1"}
    async with _client(api, tmp_path, plugin.user) as client:
        assert await client.get(CONFIGMAPS, "absent", NS) is None
        assert _ours(api) == ["Bearer eks-token-1"]
        assert plugin.runs == 1

        # The token is revoked and the plugin now issues another: the 401 makes the client
        # run the plugin again and retry, once.
        plugin.issue("eks-token-2")
        api.accept_tokens = {"eks-token-2"}
        await client.create(CONFIGMAPS, _configmap("after-rotation"))
        assert _ours(api)[1:] == ["Bearer eks-token-1", "Bearer eks-token-2"]
        assert plugin.runs == 2
        assert api.get("v1/configmaps", "after-rotation") is not None

        # A token nobody accepts: one retry, then the 401 is the answer.
        api.accept_tokens = {"something-else"}
        with pytest.raises(ApiError) as caught:
            await client.get(CONFIGMAPS, "absent", NS)
        assert caught.value.status == 401
        assert plugin.runs == 3


async def test_exec_plugin_token_is_renewed_before_it_expires(
    api: EmulatedApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(login, "EXPIRY_MARGIN_SECONDS", 58.0)
    plugin = ExecPlugin(tmp_path / "plugin")
    expiry = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(
        seconds=60
    )
    plugin.issue("short-lived-1", expires=expiry)
    async with _client(api, tmp_path, plugin.user) as client:
        credentials = await client.credentials()
        assert credentials.expires_at == expiry
        # kopf gets the same token and expiry.
        info = credentials.connection_info()
        assert info.as_http_headers() == {"Authorization": "Bearer short-lived-1"}
        assert info.expiration == expiry
        await client.get(CONFIGMAPS, "absent", NS)

        plugin.issue("short-lived-2")
        await asyncio.sleep(2.1)  # past expiry - margin
        await client.get(CONFIGMAPS, "absent", NS)
        # Renewed ahead of time, with no 401 in between.
        assert _ours(api) == ["Bearer short-lived-1", "Bearer short-lived-2"]
        assert plugin.runs == 2


async def test_in_cluster_service_account_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    ca.cert_pem.write_to_path(str(account / "ca.crt"))
    (account / "token").write_text("sa-token-1")
    (account / "namespace").write_text("team-a\n")
    monkeypatch.setattr(login, "TOKEN_FILE_RELOAD_SECONDS", 0.5)

    async with emulated_api(ssl_context=server_context, accept_tokens={"sa-token-1"}) as api:
        environ = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api.url.port),
        }
        load = functools.partial(load_credentials, service_account_dir=account, environ=environ)
        credentials = load()
        assert credentials.server == f"https://127.0.0.1:{api.url.port}"
        assert (credentials.in_cluster, credentials.namespace) == (True, "team-a")
        assert credentials.ca_path == str(account / "ca.crt")
        async with KubeClient(load, user_agent=AGENT) as client:
            await client.create(CONFIGMAPS, _configmap("over-tls"))
            assert _ours(api) == ["Bearer sa-token-1"]

            # The kubelet rotates the token file: read again after the reload period...
            (account / "token").write_text("sa-token-2")
            api.accept_tokens = {"sa-token-1", "sa-token-2"}
            await asyncio.sleep(0.6)
            await client.get(CONFIGMAPS, "over-tls", NS)
            assert _ours(api)[-1] == "Bearer sa-token-2"

            # ... and at once after a 401.
            (account / "token").write_text("sa-token-3")
            api.accept_tokens = {"sa-token-3"}
            assert await client.get(CONFIGMAPS, "over-tls", NS) is not None
            assert _ours(api)[-2:] == ["Bearer sa-token-2", "Bearer sa-token-3"]

        # The server's certificate is checked against the account's CA.
        (account / "ca.crt").write_text(trustme.CA().cert_pem.bytes().decode())
        async with KubeClient(load, user_agent=AGENT) as client:
            with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(CONFIGMAPS, "over-tls", NS)


# -- reads and watches -----------------------------------------------------------------------


async def test_list_in_pages_and_again_after_an_expired_continue(
    api: EmulatedApiServer, tmp_path: Path
) -> None:
    async with _client(api, tmp_path) as client:
        for i in range(7):
            await client.create(CONFIGMAPS, _configmap(f"cm-{i}", team="a" if i < 5 else "b"))
        listing = await client.list(CONFIGMAPS, NS, page_size=3)
        assert sorted(o["metadata"]["name"] for o in listing.items) == [f"cm-{i}" for i in range(7)]
        assert (
            listing.resource_version
            == api.get("v1/configmaps", "cm-6")["metadata"]["resourceVersion"]
        )
        lists = [r for r in api if r.action == kmock.action.LIST]
        assert [r.params.get("limit") for r in lists] == ["3", "3", "3"]
        assert [bool(r.params.get("continue")) for r in lists] == [False, True, True]

        api.expire_next_continue = True
        again = await client.list(CONFIGMAPS, NS, label_selector="team=a", page_size=2)
        assert sorted(o["metadata"]["name"] for o in again.items) == [f"cm-{i}" for i in range(5)]


async def _collect(stream: AsyncIterator[Any], into: list[Any]) -> None:
    async for item in stream:
        into.append(item)


def _names(item: Resync) -> list[str]:
    return sorted(o["metadata"]["name"] for o in item.items)


def _watches(api: EmulatedApiServer) -> list[Any]:
    return [r for r in api if r.action == kmock.action.WATCH]


async def test_follow_resumes_from_bookmarks_and_relists_after_410(
    api: EmulatedApiServer, tmp_path: Path
) -> None:
    async with _client(api, tmp_path) as client:
        await client.create(CONFIGMAPS, _configmap("cm-1"))
        seen: list[Any] = []
        follower = asyncio.create_task(
            _collect(client.follow(CONFIGMAPS, NS, timeout_seconds=2), seen)
        )
        try:
            await eventually(lambda: seen, "the first resync")
            assert isinstance(seen[0], Resync) and _names(seen[0]) == ["cm-1"]
            await client.create(CONFIGMAPS, _configmap("cm-2"))
            await eventually(lambda: len(seen) == 2, "cm-2 added")
            assert isinstance(seen[1], WatchEvent) and seen[1].type == "ADDED"

            # Other kinds move the resourceVersion on; a bookmark tells the watch so; then
            # history is compacted. Resuming from the bookmark needs no relist. (The bookmark
            # goes out just after a watch starts, so that one is there to receive it.)
            for _ in range(5):
                api.bump()
            started = len(_watches(api))
            await eventually(lambda: len(_watches(api)) > started, "a fresh watch")
            await api.bookmark("v1/configmaps")
            bookmark = api.resource_version
            api.compact()
            await eventually(
                lambda: any(
                    r.action == kmock.action.WATCH and r.params.get("resourceVersion") == bookmark
                    for r in api
                ),
                "a watch resumed from the bookmark",
            )
            await client.create(CONFIGMAPS, _configmap("cm-3"))
            await eventually(lambda: len(seen) == 3, "cm-3 added")
            assert [type(i).__name__ for i in seen] == ["Resync", "WatchEvent", "WatchEvent"]

            # No bookmark this time: the resumed watch gets 410 Gone and lists again.
            api.bump()
            api.compact()
            await eventually(lambda: len(seen) == 4, "a resync after 410")
            assert isinstance(seen[3], Resync) and _names(seen[3]) == ["cm-1", "cm-2", "cm-3"]
            await client.create(CONFIGMAPS, _configmap("cm-4"))
            await eventually(lambda: len(seen) == 5, "cm-4 added after the relist")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)


@dataclasses.dataclass
class _RecordedBackoff(Backoff):
    delays: list[float] = dataclasses.field(default_factory=list)

    def next(self) -> float:
        delay = super().next()
        self.delays.append(delay)
        return delay


async def test_follow_backs_off_on_watch_errors(api: EmulatedApiServer, tmp_path: Path) -> None:
    api.fail_watches = 4
    backoff = _RecordedBackoff(initial=0.1, maximum=0.4)
    async with _client(api, tmp_path) as client:
        seen: list[Any] = []
        follower = asyncio.create_task(
            _collect(client.follow(CONFIGMAPS, NS, label_selector="team=a", backoff=backoff), seen)
        )
        try:
            await eventually(lambda: seen, "the first resync")
            await client.create(CONFIGMAPS, _configmap("other", team="b"))
            await client.create(CONFIGMAPS, _configmap("mine", team="a"))
            await eventually(lambda: len(seen) == 2, "an event once the watch works")
            assert seen[1].object["metadata"]["name"] == "mine"  # the server filtered `other`
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    watches = _watches(api)
    assert len(watches) == 5  # four failures, then the watch that worked
    # Exponential, jittered (by at most half), capped.
    assert len(backoff.delays) == 4
    for delay, full in zip(backoff.delays, (0.1, 0.2, 0.4, 0.4), strict=True):
        assert full / 2 <= delay <= full
    assert all(r.params.get("labelSelector") == "team=a" for r in watches)
    assert all(r.params.get("allowWatchBookmarks") == "true" for r in watches)
    assert backoff.failures == 0  # reset once the watch worked


# -- writes ----------------------------------------------------------------------------------


def _llmdeployment(name: str) -> dict[str, Any]:
    return smollm2(name, NS, replicas=1)


async def test_writes_scale_status_and_events(api: EmulatedApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path) as client:
        # Server-side apply creates, then updates; the field manager is sent.
        cm = _configmap("applied")
        created = await client.apply(CONFIGMAPS, cm)
        cm["data"] = {"k": "v2"}
        updated = await client.apply(CONFIGMAPS, cm, field_manager="someone")
        assert updated["data"] == {"k": "v2"}
        assert updated["metadata"]["uid"] == created["metadata"]["uid"]
        applies = [r for r in api.writes() if r.name == "applied"]
        assert [r.params.get("fieldManager") for r in applies] == ["fleetllm", "someone"]
        assert all(r.headers["Content-Type"] == "application/apply-patch+yaml" for r in applies)

        # Delete: background propagation; False for an object that is not there.
        await client.apply(CONFIGMAPS, _configmap("doomed"))
        assert await client.delete(CONFIGMAPS, "doomed", NS) is True
        assert api.get("v1/configmaps", "doomed") is None
        assert [r.params.get("propagationPolicy") for r in api.writes() if r.name == "doomed"][
            -1
        ] == "Background"
        assert await client.delete(CONFIGMAPS, "doomed", NS) is False

        # Merge and JSON patches.
        await client.patch(CONFIGMAPS, "applied", {"data": {"extra": "1"}}, NS)
        patched = await client.patch(
            CONFIGMAPS, "applied", [{"op": "remove", "path": "/data/k"}], NS, patch_type="json"
        )
        assert patched["data"] == {"extra": "1"}
        with pytest.raises(ApiError) as caught:
            await client.patch(CONFIGMAPS, "missing", {"data": {}}, NS)
        assert caught.value.not_found and caught.value.reason

        # Status, guarded by the resourceVersion read.
        ld = await client.create(LLMDEPLOYMENTS, _llmdeployment("chat"))
        version = ld["metadata"]["resourceVersion"]
        await client.patch_status(
            LLMDEPLOYMENTS, "chat", {"replicas": 1}, NS, resource_version=version
        )
        with pytest.raises(ApiError) as caught:
            await client.patch_status(
                LLMDEPLOYMENTS, "chat", {"replicas": 2}, NS, resource_version=version
            )
        assert caught.value.conflict
        assert api.get(CR_RESOURCE, "chat")["status"] == {"replicas": 1}

        # The scale subresource, of our kind and of a Deployment.
        scale = await client.get_scale(LLMDEPLOYMENTS, "chat", NS)
        assert scale is not None and scale["kind"] == "Scale"
        assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (1, 1)
        await client.patch_scale(LLMDEPLOYMENTS, "chat", 3, NS)
        assert api.get(CR_RESOURCE, "chat")["spec"]["replicas"] == 3
        with pytest.raises(ApiError) as caught:
            await client.patch_scale(LLMDEPLOYMENTS, "chat", 4, NS, resource_version=version)
        assert caught.value.conflict
        assert await client.get_scale(DEPLOYMENTS, "absent", NS) is None

        # An Event about the LLMDeployment (the server validates it against the schema).
        body = await client.get(LLMDEPLOYMENTS, "chat", NS)
        assert body is not None
        await client.create_event(
            body, type="Normal", reason="Scaled", message="x" * 2000, component="fleetllm-test"
        )
        (event,) = api.list("v1/events")
        assert event["involvedObject"]["uid"] == body["metadata"]["uid"]
        assert event["involvedObject"]["kind"] == KIND
        assert (event["reason"], event["type"]) == ("Scaled", "Normal")
        assert len(event["message"]) == EVENT_MESSAGE_LIMIT
