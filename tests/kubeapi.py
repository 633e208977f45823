"""An emulated Kubernetes API server for tests of the operator, the router and fleetllm.kube.

kmock's KubernetesEmulator stores objects and streams watch events; `EmulatedApiServer` adds
what our clients rely on from a real API server (kmock 0.8 lacks it):
- resourceVersion (one counter for all kinds), uid, generation (bumped on spec changes),
  creationTimestamp; generateName; 409 on create of an existing object and on a stale
  resourceVersion;
- status-subresource rules: /status writes only status, the main resource never does;
- the scale subresource (GET answers an autoscaling/v1 Scale, PATCH sets spec.replicas);
- server-side apply creates a missing object (merge semantics otherwise, as in kmock), and
  is then recorded (`created_by_apply`: a real server authorizes it as create as well);
- writes of a kind the server does not know answer 404 (e.g. a CRD that is not installed);
- a failed JSON-patch `test` operation answers 422, not 500;
- label selectors (`k=v`, `k!=v`, `k`, `!k`) on lists and watches;
- lists in pages (`limit`/`continue`, served from one snapshot);
- watches that honour `resourceVersion` (snapshot and subscription taken atomically, so no
  stale or duplicate events), `timeoutSeconds`, and `allowWatchBookmarks`; after `compact()`,
  a watch or a continue token older than the compaction gets 410 Gone, as from etcd;
- optional bearer-token authentication (`accept_tokens`): other requests get 401; every
  request's Authorization header is recorded with its User-Agent;
- every stored object validated: built-in kinds against the Kubernetes 1.30 and 1.37 JSON
  schemas (strict), LLMDeployments against the generated CRD schema; invalid writes get 422
  and are recorded, and the test fails.
It has no garbage collector and no controllers: tests play the Deployment controller.
What it does to objects (selectors, merge patches, schema validation) is in kubeobjects.py;
kubeconfigs and an exec credential plugin to log in with are in kubelogin.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import secrets
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch
import kmock
import pytest
from kmock._internal import dsl, rendering
from kubeobjects import Schemas, merge, now, parse_selector, selected, status_object

from fleetllm.api.deployment import GROUP, KIND, PLURAL, VERSION

NAMESPACE = "default"
CR_RESOURCE = f"{GROUP}/{VERSION}/{PLURAL}"
# For the tests that use the emulator: kmock 0.8 loads its bundled resource list with a
# deprecated importlib call.
KMOCK_WARNINGS = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def _holds(view: dsl.View, request: rendering.Request) -> bool:
    """Whether `view` holds `request`, the latest request: along a chain of filters and
    priorities, by each filter's criteria alone; for any other view (a slice, a group, an
    exclusion) by kmock's own scan of the requests so far."""
    while not isinstance(view, dsl.Root):
        if type(view) is dsl.Filter:
            if not view.criteria(request):
                return False
        elif type(view) is not dsl.Priority:
            return request in view
        view = view._source
    return True


@attrs.define(kw_only=True)
class EmulatedApiServer(kmock.KubernetesEmulator):
    accept_tokens: set[str] | None = None
    """None: no authentication; else only these bearer tokens are let in."""
    fail_watches: int = 0
    """Answer this many next watch requests with 500."""
    outage_agents: tuple[str, ...] = ()
    """Answer every request whose User-Agent starts with one of these with 503 (an API
    outage as one client sees it; the test's own requests still go through)."""
    expire_next_continue: bool = False
    """Answer the next continue token with 410 Gone."""
    authorizations: list[tuple[str, str]] = attrs.field(factory=list, init=False)
    """(User-Agent, Authorization) of every request, in order."""
    created_by_apply: list[rendering.Request] = attrs.field(factory=list, init=False)
    """Server-side applies that created their object (authorized as create, too)."""
    validation_errors: list[str] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _log: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(
        factory=lambda: collections.defaultdict(list), init=False
    )
    _pages: dict[str, tuple[int, list[dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    _schemas: Schemas = attrs.field(
        factory=lambda: Schemas(kmock.resource(CR_RESOURCE)), init=False
    )

    # -- dispatch ------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> Any:
        authorization = request.headers.get("Authorization", "")
        self.authorizations.append((request.headers.get("User-Agent", ""), authorization))
        if self.accept_tokens is not None and authorization not in {
            f"Bearer {t}" for t in self.accept_tokens
        }:
            return aiohttp.web.json_response(
                status_object(401, "Unauthorized", "Unauthorized"), status=401
            )
        if self.outage_agents and request.headers.get("User-Agent", "").startswith(
            self.outage_agents
        ):
            return aiohttp.web.json_response(
                status_object(503, "ServiceUnavailable", "injected outage"), status=503
            )
        if self.fail_watches > 0 and request.action == kmock.action.WATCH:
            self.fail_watches -= 1
            return aiohttp.web.json_response(
                status_object(500, "InternalError", "injected failure"), status=500
            )
        if request.resource is not None and request.subresource == "scale":
            return await self._answer(self._scale, request)
        if request.resource is not None and request.action in (
            kmock.action.CREATE,
            kmock.action.UPDATE,
            kmock.action.DELETE,
        ):
            return await self._answer(self._mutate, request)
        return await self._react(request)

    async def _react(self, request: rendering.Request) -> Any:
        """kmock's dispatch to its reactions (RawHandler._handle), with `_holds` telling which
        reactions' views hold the request: kmock itself scans every request served so far, for
        each reaction, so each answer took longer than the one before and a test of a few
        thousand requests spent most of its time there."""
        # The highest priority first; kmock pads priorities of unequal length with zeroes.
        width = max((len(p.priorities) for p in self._payloads), default=0)
        ordered = sorted(
            self._payloads,
            key=lambda p: tuple(-x for x in p.priorities) + (0,) * (width - len(p.priorities)),
        )
        for payload in ordered:
            if _holds(payload._source, request) and not payload._disabled.is_set():
                try:
                    return await payload(request)
                except rendering.ReactionMismatchError:  # a mismatch, or used up
                    payload._disabled.set()
                except NotImplementedError:  # matched, with nothing to answer
                    pass
        raise NotImplementedError(f"no reaction for {request}")

    async def _answer(
        self,
        write: Callable[[rendering.Request], Awaitable[tuple[int, dict[str, Any]]]],
        request: rendering.Request,
    ) -> Any:
        """One write, under the lock that keeps resourceVersions and watches in order."""
        try:
            async with self._lock:
                status, obj = await write(request)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        return aiohttp.web.json_response(obj, status=status)

    # -- state changes -------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _emit(self, resource: Any, type_: str, obj: dict[str, Any]) -> None:
        event = {"type": type_, "object": copy.deepcopy(obj)}
        self._log[resource].append((int(obj["metadata"]["resourceVersion"]), event))
        await self._buses[resource].put(event)

    def _validate(self, resource: Any, obj: dict[str, Any]) -> None:
        problems = self._schemas.problems(resource, obj)
        if problems:
            where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
            self.validation_errors.extend(f"{where}: {p}" for p in problems)
            raise kmock.KubernetesError(status=422, reason="Invalid", message="; ".join(problems))

    def _has_status_subresource(self, resource: Any) -> bool:
        return "status" in self._resources[resource].subresources

    async def _create(
        self, resource: Any, namespace: str | None, obj: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        obj = copy.deepcopy(obj)
        # The URL names the type; clients may leave it out of the body.
        group_version = f"{resource.group}/{resource.version}".lstrip("/")
        obj.setdefault("apiVersion", group_version)
        obj.setdefault("kind", self._resources[resource].kind)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise kmock.KubernetesError(status=422, reason="Invalid", message="name missing")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        namespace = namespace or meta.get("namespace")
        key = (resource, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists", message="exists")
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_rv(),
            generation=1,
            creationTimestamp=now(),
        )
        meta.pop("generateName", None)
        self._validate(resource, obj)
        if key in self._objects:
            self._objects[key].history.append(obj)
        else:
            self._objects[key] = obj
        await self._emit(resource, "ADDED", obj)
        return 201, obj

    async def _mutate(self, request: rendering.Request) -> tuple[int, dict[str, Any]]:
        """Apply one write; the HTTP status and the object to answer with."""
        resource, namespace, name = request.resource, request.namespace, request.name
        if resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()  # a kind the cluster does not have
        if request.action == kmock.action.CREATE:
            return await self._create(resource, namespace, request.data or {})
        key = (resource, namespace, name)
        exists = key in self._objects and not self._objects[key].deleted
        content_type = request.headers.get("Content-Type", "")
        if request.action == kmock.action.UPDATE and not exists:
            if "apply-patch" in content_type and request.subresource is None:
                self.created_by_apply.append(request)
                return await self._create(resource, namespace, request.data or {})
            raise kmock.KubernetesObjectNotFoundError()
        if not exists:
            raise kmock.KubernetesObjectNotFoundError()

        old = copy.deepcopy(self._objects[key].raw)
        if request.action == kmock.action.DELETE:
            if old["metadata"].get("finalizers"):
                old["metadata"].setdefault("deletionTimestamp", now())
                old["metadata"]["resourceVersion"] = self._next_rv()
                self._objects[key].history.append(old)
                await self._emit(resource, "MODIFIED", old)
                return 200, old
            return 200, await self._delete(key, old)

        patch = request.data
        if isinstance(patch, list):
            try:
                new = jsonpatch.apply_patch(old, patch, in_place=False)
            except (jsonpatch.JsonPatchConflict, jsonpatch.JsonPatchTestFailed) as exc:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message=str(exc)
                ) from None
        else:
            patch = copy.deepcopy(patch or {})
            wanted_rv = (patch.get("metadata") or {}).pop("resourceVersion", None)
            if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(status=409, reason="Conflict", message="stale rv")
            if request.subresource == "status":
                patch = {"status": patch.get("status")}
            elif request.subresource is None and self._has_status_subresource(resource):
                patch.pop("status", None)
            new = merge(old, patch)
        return await self._store(key, old, new)

    async def _store(
        self, key: Any, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        for field in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if field in old["metadata"]:
                new["metadata"][field] = old["metadata"][field]
        if new == old:
            return 200, old  # a no-op write changes nothing, as on a real server
        spec_changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }
        if spec_changed:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._validate(key[0], new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return 200, await self._delete(key, new)
        self._objects[key].history.append(new)
        await self._emit(key[0], "MODIFIED", new)
        return 200, new

    async def _delete(self, key: Any, last: dict[str, Any]) -> dict[str, Any]:
        self._objects[key].delete()
        gone = copy.deepcopy(last)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        await self._emit(key[0], "DELETED", gone)
        return gone

    async def _scale(self, request: rendering.Request) -> tuple[int, dict[str, Any]]:
        """The scale subresource: .spec.replicas, .status.replicas, .status.selector."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        if "scale" not in self._resources[request.resource].subresources:
            raise kmock.KubernetesError(status=404, reason="NotFound", message="no scale")
        old = copy.deepcopy(self._objects[key].raw)
        status = 200
        if request.method == kmock.method.PATCH:
            patch = copy.deepcopy(request.data or {})
            wanted_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(status=409, reason="Conflict", message="stale rv")
            replicas = (patch.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise kmock.KubernetesError(status=422, reason="Invalid", message="replicas")
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = replicas
            status, old = await self._store(key, old, new)
        elif request.method != kmock.method.GET:
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="scale")
        selector = (old.get("status") or {}).get("selector")
        if selector is None:
            labels = ((old.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        meta = old["metadata"]
        return status, {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": (old.get("spec") or {}).get("replicas", 0)},
            "status": {
                "replicas": (old.get("status") or {}).get("replicas", 0),
                "selector": selector,
            },
        }

    # -- reads ---------------------------------------------------------------------------

    def _matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (
            (request.namespace is None or meta.get("namespace") == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and selected(parse_selector(request.params.get("labelSelector", "")), obj)
        )

    def _current(self, request: rendering.Request) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (resource, _, _), obj in self._objects.items()
            if resource == request.resource and not obj.deleted and self._matches(request, obj.raw)
        ]

    async def _serve_list(self, request: rendering.Request) -> dict[str, Any]:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            token = request.params.get("continue")
            if token and self.expire_next_continue:
                self.expire_next_continue = False
                self._pages.pop(token, None)
            if token:
                if token not in self._pages:
                    raise kmock.KubernetesError(
                        status=410, reason="Expired", message="continue token expired"
                    )
                rv, items = self._pages.pop(token)
            else:
                rv, items = self._rv, copy.deepcopy(self._current(request))
            limit = int(request.params.get("limit") or 0)
            meta: dict[str, Any] = {"resourceVersion": str(rv)}
            if limit and len(items) > limit:
                items, rest = items[:limit], items[limit:]
                meta["continue"] = secrets.token_hex(8)
                self._pages[meta["continue"]] = (rv, rest)
            return {"metadata": meta, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion")
        bookmarks = request.params.get("allowWatchBookmarks") == "true"
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        async with self._lock:
            if since and since != "0" and int(since) < self._compacted:
                yield {"type": "ERROR", "object": status_object(410, "Expired", "too old")}
                return
            marker = await bus.mark()
            if since and since != "0":
                backlog = [
                    event
                    for rv, event in self._log[request.resource]
                    if rv > int(since) and self._matches(request, event["object"])
                ]
            else:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._current(request)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stream = bus.stream(since=marker)
        try:
            for event in backlog:
                yield event
            while (remaining := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(anext(stream), remaining)
                except TimeoutError:
                    return
                if event["type"] == "BOOKMARK":
                    if bookmarks:
                        yield event
                elif self._matches(request, event["object"]):
                    yield event
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
            await bus.unmark(marker)

    # -- test helpers --------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    async def bookmark(self, resource: str) -> None:
        """Send a BOOKMARK with the current resourceVersion to the watches that allow them."""
        res = kmock.resource(resource)
        info = self._resources[res]
        group_version = f"{res.group}/{res.version}".lstrip("/")
        obj = {
            "apiVersion": group_version,
            "kind": info.kind,
            "metadata": {"resourceVersion": str(self._rv)},
        }
        await self._buses[res].put({"type": "BOOKMARK", "object": obj})

    def compact(self) -> None:
        """Forget history, as etcd compaction does: older resourceVersions and continue
        tokens get 410 Gone from now on."""
        self._compacted = self._rv
        self._pages.clear()
        for entries in self._log.values():
            entries.clear()

    def bump(self) -> None:
        """Advance the resourceVersion, as writes to other kinds do on a real server."""
        self._next_rv()

    def get(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def list(self, resource: str) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        return [
            copy.deepcopy(obj.raw)
            for (res, _, _), obj in self._objects.items()
            if res == wanted and not obj.deleted
        ]

    def writes(self) -> list[rendering.Request]:
        return [
            r
            for r in self
            if r.method
            in (kmock.method.POST, kmock.method.PATCH, kmock.method.PUT, kmock.method.DELETE)
        ]


class _TLSTestServer(aiohttp.test_utils.RawTestServer):
    def __init__(self, handler: Any, *, ssl_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._tls = ssl_context

    async def start_server(self, **kwargs: Any) -> None:
        await super().start_server(ssl=self._tls, **kwargs)


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Wait until `check()` returns something truthy (servers and operators work
    asynchronously); fail the test, naming `what`, if it never does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if result:
            return result
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def emulated_api(
    ssl_context: ssl.SSLContext | None = None, **kwargs: Any
) -> AsyncIterator[EmulatedApiServer]:
    """The server, listening (over TLS with `ssl_context`), with the built-in kinds and the
    LLMDeployment CRD; at exit, fails the test on any invalid write or emulator crash."""
    server = EmulatedApiServer(**kwargs)
    server.resources.load_bundled()
    server.resources[CR_RESOURCE] = kmock.ResourceInfo(
        kind=KIND,
        singular=KIND.lower(),
        namespaced=True,
        shortnames={"llmd"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    listener = (
        kmock.Server(server)
        if ssl_context is None
        else kmock.Server(
            server,
            server_cls=lambda handler, **kw: _TLSTestServer(handler, ssl_context=ssl_context, **kw),
        )
    )
    async with server, listener:
        yield server
        assert not server.validation_errors, server.validation_errors
        # API errors (404 on a read, 409, 422) are answers; anything else is an emulator bug.
        crashes = [e for e in server.errors if not isinstance(e, kmock.KubernetesError)]
        assert not crashes, crashes
