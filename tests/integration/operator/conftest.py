"""An emulated Kubernetes API server for the operator, and the operator running against it.

kmock's KubernetesEmulator stores objects and streams watch events; `EmulatedApiServer` adds
what an operator relies on from a real API server (kmock 0.8 lacks it):
- resourceVersion, uid, generation (bumped on spec changes), creationTimestamp;
- generateName; 409 on create of an existing object and on a stale resourceVersion;
- status-subresource rules: /status writes only status, the main resource never does;
- server-side apply creates a missing object (merge semantics otherwise, as in kmock);
- a failed JSON-patch `test` operation answers 422, not 500;
- list resourceVersions and watches that honour ?resourceVersion, with the snapshot and the
  subscription taken atomically, so no stale or duplicate events;
- every stored object validated: built-in kinds against the Kubernetes 1.30 and 1.37 JSON
  schemas (strict), LLMDeployments against the generated CRD schema; invalid writes get 422
  and are recorded, and the test fails.
It has no garbage collector and no controllers: tests play the Deployment controller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime
import logging
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import kopf
import kubernetes_validate
import pytest
import pytest_asyncio
from kmock._internal import apps, rendering
from openapi_schema_validator import OAS30Validator

from fleetllm.operator.api import GROUP, KIND, PLURAL, VERSION
from fleetllm.operator.crd import openapi_schema
from fleetllm.operator.handlers import OperatorState, build_registry, make_settings

NAMESPACE = "default"
CR_RESOURCE = f"{GROUP}/{VERSION}/{PLURAL}"
KUBERNETES_VERSIONS = ("1.30", "1.37")
VALIDATED_GROUPS = {"", "apps", "policy"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class EmulatedApiServer(kmock.KubernetesEmulator):
    _rv: int = attrs.field(default=0, init=False)
    _log: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(
        factory=lambda: collections.defaultdict(list), init=False
    )
    validation_errors: list[str] = attrs.field(factory=list, init=False)
    _cr_validator: Any = attrs.field(factory=lambda: OAS30Validator(openapi_schema()), init=False)

    # -- state changes -------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and request.action in (
            kmock.action.CREATE,
            kmock.action.UPDATE,
            kmock.action.DELETE,
        ):
            try:
                async with self._lock:
                    status, obj = await self._mutate(request)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
            return aiohttp.web.json_response(obj, status=status)
        return await apps.RawHandler._handle(self, request)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _emit(self, resource: Any, type_: str, obj: dict[str, Any]) -> None:
        event = {"type": type_, "object": copy.deepcopy(obj)}
        self._log[resource].append((int(obj["metadata"]["resourceVersion"]), event))
        await self._buses[resource].put(event)

    def _validate(self, resource: Any, obj: dict[str, Any]) -> None:
        problems: list[str] = []
        if resource == kmock.resource(CR_RESOURCE):
            problems += [f"{e.json_path}: {e.message}" for e in self._cr_validator.iter_errors(obj)]
        elif resource.group in VALIDATED_GROUPS:
            for version in KUBERNETES_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    problems.append(f"{version}: {'.'.join(map(str, exc.path))}: {exc.message}")
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
            creationTimestamp=_now(),
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
        if request.action == kmock.action.CREATE:
            return await self._create(resource, namespace, request.data or {})
        key = (resource, namespace, name)
        exists = key in self._objects and not self._objects[key].deleted
        content_type = request.headers.get("Content-Type", "")
        if request.action == kmock.action.UPDATE and not exists:
            if "apply-patch" in content_type and request.subresource is None:
                return await self._create(resource, namespace, request.data or {})
            raise kmock.KubernetesObjectNotFoundError()
        if not exists:
            raise kmock.KubernetesObjectNotFoundError()

        old = copy.deepcopy(self._objects[key].raw)
        if request.action == kmock.action.DELETE:
            if old["metadata"].get("finalizers"):
                old["metadata"].setdefault("deletionTimestamp", _now())
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
            new = _merge(old, patch)

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
        self._validate(resource, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return 200, await self._delete(key, new)
        self._objects[key].history.append(new)
        await self._emit(resource, "MODIFIED", new)
        return 200, new

    async def _delete(self, key: Any, last: dict[str, Any]) -> dict[str, Any]:
        self._objects[key].delete()
        gone = copy.deepcopy(last)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        await self._emit(key[0], "DELETED", gone)
        return gone

    # -- reads ---------------------------------------------------------------------------

    def _matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (request.namespace is None or meta.get("namespace") == request.namespace) and (
            request.name is None or meta.get("name") == request.name
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
            return {"metadata": {"resourceVersion": str(self._rv)}, "items": self._current(request)}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion")
        async with self._lock:
            marker = await bus.mark()
            if since and since != "0":
                backlog = [
                    event
                    for rv, event in self._log[request.resource]
                    if rv > int(since) and self._matches(request, event["object"])
                ]
            else:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._current(request)]
        try:
            for event in backlog:
                yield event
            async for event in bus.stream(since=marker):
                if self._matches(request, event["object"]):
                    yield event
        finally:
            await bus.unmark(marker)

    # -- test helpers --------------------------------------------------------------------

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


def _merge(old: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


@pytest_asyncio.fixture()
async def api() -> AsyncIterator[EmulatedApiServer]:
    server = EmulatedApiServer()
    server.resources.load_bundled()
    server.resources[CR_RESOURCE] = kmock.ResourceInfo(
        kind=KIND,
        singular=KIND.lower(),
        namespaced=True,
        shortnames={"llmd"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    async with server, kmock.Server(server):
        yield server
        assert not server.validation_errors, server.validation_errors
        # API errors (404 on a read, 409, 422) are answers; anything else is an emulator bug.
        crashes = [e for e in server.errors if not isinstance(e, kmock.KubernetesError)]
        assert not crashes, crashes


class _CycleCounter(logging.Handler):
    """Counts kopf's finished handling cycles per LLMDeployment: the moment after which kopf
    has written all it will write for an event (its own annotations included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.finished: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        ref = getattr(record, "k8s_ref", None) or {}
        if ref.get("kind") == KIND and record.getMessage().startswith("Handling cycle is finished"):
            self.finished[ref.get("name", "")] += 1


class RunningOperator:
    """The operator in its own thread and event loop, as in production (one process)."""

    def __init__(self, url: str) -> None:
        self.state = OperatorState.create(lambda: kopf.ConnectionInfo(server=url))
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)
        self._cycles = _CycleCounter()
        self.failure: BaseException | None = None

    def _main(self) -> None:
        settings = make_settings(standalone=True)
        settings.scanning.disabled = True  # kmock cannot list namespaces or watch CRDs
        settings.watching.reconnect_backoff = 0.05
        try:
            asyncio.run(
                kopf.operator(
                    registry=build_registry(),
                    settings=settings,
                    memo=self.state,
                    namespaces=[NAMESPACE],
                    standalone=True,
                    stop_flag=self._stop,
                    ready_flag=self._ready,
                )
            )
        except BaseException as exc:
            self.failure = exc

    async def start(self) -> None:
        kopf_objects = logging.getLogger("kopf.objects")
        kopf_objects.addHandler(self._cycles)
        kopf_objects.setLevel(logging.DEBUG)
        self._thread.start()
        started = await asyncio.to_thread(self._ready.wait, 30)
        assert started and self.failure is None, f"operator did not start: {self.failure!r}"

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 30)
        logging.getLogger("kopf.objects").removeHandler(self._cycles)
        assert not self._thread.is_alive(), "operator did not stop"

    def reconciles(self, name: str) -> int:
        return self.state.reconciler.counts[NAMESPACE, name]

    def handled_cycles(self, name: str) -> int:
        return self._cycles.finished[name]


@pytest_asyncio.fixture()
async def start_operator(
    api: EmulatedApiServer,
) -> AsyncIterator[Callable[[], Any]]:
    running: list[RunningOperator] = []

    async def start() -> RunningOperator:
        operator = RunningOperator(str(api.url).rstrip("/"))
        running.append(operator)
        await operator.start()
        return operator

    yield start
    for operator in running:
        with contextlib.suppress(AssertionError):
            await operator.stop()


async def _eventually(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@pytest.fixture()
def eventually() -> Callable[..., Any]:
    """`await eventually(check, what)`: wait until `check()` returns something truthy (the
    operator works asynchronously); fail the test, naming `what`, if it never does."""
    return _eventually
