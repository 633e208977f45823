"""The operator's adapter loader: gets each LLMDeployment's LoRA adapters (spec.adapters) to its
replicas and reports each one in status.adapters, without ever changing the engine pods.

A kopf timer (handlers.py) calls `AdapterLoader.step` for every LLMDeployment with spec.lora
(and, to stand down, one that had adapters reported). A step:

1. places each adapter where every replica reads it (`ClusterPlacement.adapter_path`): the
   shared model cache for hf:// and s3:// ones, pulled there once by a Job of the engine pods'
   own model-pull container (render_lora.py); the model's claim or the cache claim for
   pvc:// ones. One that cannot be placed is Failed with the reason;
2. lists each ready replica's adapters (`/v1/models`, with the LLMDeployment's engine key),
   loads what it lacks and unloads what spec.adapters no longer lists, through vLLM's load
   API, which both backends serve. A replica that restarted holds none: the next step loads
   them again. A load the engine refuses is not tried again for that adapter and folder until
   its backoff passes (doubling, up to an hour), and the adapter is Failed with the engine's
   reason meanwhile;
3. writes status.adapters (Ready on every ready replica, Pending on its way, Failed and why)
   when it changed, under its own field manager: that field is the loader's alone.

The engine pods' template never reads spec.adapters, so adding or removing one restarts
nothing; the pods' LoRA slots and load API come with spec.lora.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import aiohttp

from fleetllm.api.contract import ENGINE_KEY_FIELD, engine_key, engine_key_secret, selector_string
from fleetllm.api.deployment import LLMDEPLOYMENTS, LLMDeployment
from fleetllm.api.lora import AdapterSpec
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.api.source import ModelSource
from fleetllm.api.status import AdapterStatus
from fleetllm.kube.client import KubeClient
from fleetllm.kube.errors import ApiError
from fleetllm.kube.resources import JOBS, PODS, SECRETS
from fleetllm.lora_api import AdapterError, list_adapters, load_adapter, short, unload_adapter
from fleetllm.operator.engine_http import EngineHttp
from fleetllm.operator.render_lora import (
    COMPONENT,
    LABEL_ADAPTER,
    pull_job_name,
    render_pull_job,
)
from fleetllm.operator.scaler import ready_pods
from fleetllm.planner.placement import IN_CLUSTER
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig

logger = logging.getLogger("fleetllm.operator")

FIELD_MANAGER = "fleetllm-adapters"
REFUSED_BACKOFF_S = 60.0
REFUSED_BACKOFF_MAX_S = 3600.0
# (body of the LLMDeployment, event type, reason, message)
EventSink = Callable[[dict[str, Any], str, str, str], Awaitable[None]]


def reported(body: Mapping[str, Any]) -> bool:
    """Whether the loader has work there: spec.lora, or adapters still reported."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    return spec.get("lora") is not None or status.get("adapters") is not None


@dataclass
class _Refusal:
    count: int
    until: float
    reason: str


def _status(name: str, state: str, reason: str, message: str = "", **more: Any) -> AdapterStatus:
    return AdapterStatus(name=name, state=state, reason=reason, message=message, **more)  # type: ignore[arg-type]


def _job_failure(job: Mapping[str, Any]) -> str | None:
    """Why a finished pull Job failed; None while it runs or once it succeeded."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip(": ")
    return None


def _job_done(job: Mapping[str, Any]) -> bool:
    return int((job.get("status") or {}).get("succeeded") or 0) >= 1


def _termination_message(pods: list[dict[str, Any]]) -> str | None:
    """The pull's own last words: the termination message of its latest failed container."""
    found = None
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name") or ""):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if terminated.get("exitCode") and terminated.get("message"):
                found = str(terminated["message"]).strip().splitlines()[-1]
    return found


@dataclass(eq=False)
class AdapterLoader:
    client: KubeClient
    emit: EventSink
    _: KW_ONLY
    config: OperatorConfig = DEFAULT_CONFIG
    engine_key_root: str = ""
    timeout: float = 120.0
    clock: Callable[[], float] = time.monotonic
    http: EngineHttp = field(default_factory=EngineHttp)
    _refused: dict[tuple[str, str, str, str], _Refusal] = field(default_factory=dict, init=False)

    async def close(self) -> None:
        await self.http.close()

    def _session(self) -> aiohttp.ClientSession:
        return self.http.session()

    async def step(self, body: Mapping[str, Any]) -> list[AdapterStatus] | None:
        """One pass over one LLMDeployment; its adapters' states (None when it has no LoRA,
        is gone, or its spec is invalid: the reconciler reports that)."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        try:
            cr = parse_llmdeployment(dict(body), f"LLMDeployment {namespace}/{name}")
        except ValueError:
            return None
        if cr.spec.lora is None:
            await self._stand_down(body, namespace, name)
            return None
        statuses: dict[str, AdapterStatus] = {}
        placed: dict[str, str] = {}
        jobs: set[str] = set()
        model = ModelSource.parse(cr.spec.model.source)
        claim = self.config.model_cache.claim_name if self.config.model_cache else None
        for adapter in cr.spec.adapters:
            try:
                path = IN_CLUSTER.adapter_path(adapter.model_source(), model, claim)
            except ValueError as exc:
                statuses[adapter.name] = _status(adapter.name, "Failed", "Unplaceable", str(exc))
                continue
            if adapter.model_source().downloaded:
                jobs.add(pull_job_name(name, adapter, path))
                pulling = await self._pull(cr, adapter, path, namespace)
                if pulling is not None:
                    statuses[adapter.name] = pulling
                    continue
            placed[adapter.name] = path
        await self._remove_other_jobs(namespace, name, jobs)
        statuses |= await self._load(cr, body, namespace, name, placed)
        ordered = [statuses[a.name] for a in cr.spec.adapters]
        await self._record(body, namespace, name, ordered)
        return ordered

    # -- files -------------------------------------------------------------------------------

    async def _pull(
        self, cr: LLMDeployment, adapter: AdapterSpec, path: str, namespace: str
    ) -> AdapterStatus | None:
        """Pending or Failed while the adapter's pull Job has not put it in place; None once
        it has."""
        job_name = pull_job_name(cr.metadata.name, adapter, path)
        job = await self.client.get(JOBS, job_name, namespace)
        if job is None:
            desired = render_pull_job(cr, adapter, path, self.config)
            desired["metadata"]["namespace"] = namespace
            try:
                await self.client.apply(JOBS, desired)
            except ApiError as exc:
                if exc.status not in (400, 422):
                    raise
                return _status(adapter.name, "Failed", "PullRejected", short(exc.message))
            logger.info(
                "adapter pull started",
                extra={"llmdeployment": f"{namespace}/{cr.metadata.name}", "job": job_name},
            )
            return _status(adapter.name, "Pending", "Pulling", f"Job {job_name}", path=path)
        if _job_done(job):
            return None
        failure = _job_failure(job)
        if failure is None:
            return _status(adapter.name, "Pending", "Pulling", f"Job {job_name}", path=path)
        selector = f"app.kubernetes.io/instance={cr.metadata.name},job-name={job_name}"
        pods = await self.client.list(PODS, namespace, label_selector=selector)
        said = _termination_message(pods.items)
        message = f"Job {job_name} failed ({failure})" + (f": {said}" if said else "")
        return _status(adapter.name, "Failed", "PullFailed", short(message))

    async def _remove_other_jobs(self, namespace: str, name: str, keep: set[str]) -> None:
        """Pull Jobs of adapters (or sources, revisions) spec.adapters no longer lists."""
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={COMPONENT}"
        listing = await self.client.list(JOBS, namespace, label_selector=selector)
        for job in listing.items:
            job_name = (job.get("metadata") or {}).get("name") or ""
            if job_name and job_name not in keep:
                await self.client.delete(JOBS, job_name, namespace)
                logger.info(
                    "adapter pull Job removed",
                    extra={
                        "llmdeployment": f"{namespace}/{name}",
                        "job": job_name,
                        "adapter": ((job.get("metadata") or {}).get("labels") or {}).get(
                            LABEL_ADAPTER
                        ),
                    },
                )

    # -- replicas ----------------------------------------------------------------------------

    async def _key_headers(self, body: Mapping[str, Any], namespace: str, name: str) -> dict:
        """The LLMDeployment's engine key: derived from the fleet's root, else its Secret's."""
        uid = (body.get("metadata") or {}).get("uid")
        if self.engine_key_root and uid:
            key = engine_key(self.engine_key_root, namespace, name, uid)
            return {"Authorization": f"Bearer {key}"}
        secret = await self.client.get(SECRETS, engine_key_secret(name), namespace)
        encoded = ((secret or {}).get("data") or {}).get(ENGINE_KEY_FIELD)
        if not encoded:
            return {}
        return {"Authorization": f"Bearer {base64.b64decode(encoded).decode()}"}

    async def _load(
        self,
        cr: LLMDeployment,
        body: Mapping[str, Any],
        namespace: str,
        name: str,
        placed: dict[str, str],
    ) -> dict[str, AdapterStatus]:
        listing = await self.client.list(PODS, namespace, label_selector=selector_string(name))
        urls = ready_pods(listing.items)
        headers = await self._key_headers(body, namespace, name) if urls else {}
        wanted = {a.name for a in cr.spec.adapters}
        loaded = dict.fromkeys(placed, 0)
        now = self.clock()
        for url in urls.values():
            try:
                held = await list_adapters(self._session(), url, headers=headers)
            except AdapterError as exc:
                logger.info("replica unreadable", extra={"replica": url, "error": exc.message})
                continue
            for stale in sorted(set(held) - wanted):
                try:
                    await unload_adapter(self._session(), url, stale, headers=headers)
                except AdapterError as exc:
                    logger.warning(
                        "adapter not unloaded",
                        extra={"replica": url, "adapter": stale, "error": exc.message},
                    )
            for adapter, path in placed.items():
                key = (namespace, name, adapter, path)
                refusal = self._refused.get(key)
                if adapter in held:
                    loaded[adapter] += 1
                elif refusal is None or now >= refusal.until:
                    try:
                        await load_adapter(
                            self._session(),
                            url,
                            adapter,
                            path,
                            headers=headers,
                            timeout=self.timeout,
                        )
                    except AdapterError as exc:
                        if not exc.transient:
                            self._refuse(key, exc.message, now)
                        continue
                    loaded[adapter] += 1
                    self._refused.pop(key, None)
        return {
            adapter: self._state(adapter, path, loaded[adapter], len(urls), namespace, name)
            for adapter, path in placed.items()
        }

    def _refuse(self, key: tuple[str, str, str, str], reason: str, now: float) -> None:
        previous = self._refused.get(key)
        count = previous.count + 1 if previous is not None else 1
        wait = min(REFUSED_BACKOFF_MAX_S, REFUSED_BACKOFF_S * 2 ** min(count - 1, 30))
        self._refused[key] = _Refusal(count, now + wait, reason)

    def _state(
        self, adapter: str, path: str, loaded: int, ready: int, namespace: str, name: str
    ) -> AdapterStatus:
        refusal = self._refused.get((namespace, name, adapter, path))
        if refusal is not None:
            return _status(adapter, "Failed", "LoadRefused", refusal.reason, loaded_replicas=loaded)
        where = {"path": path, "loaded_replicas": loaded}
        if ready == 0:
            return _status(adapter, "Pending", "NoReplicaReady", "no replica is ready", **where)
        if loaded == ready:
            return _status(
                adapter, "Ready", "Loaded", f"on {loaded}/{ready} ready replicas", **where
            )
        return _status(
            adapter, "Pending", "Loading", f"on {loaded}/{ready} ready replicas", **where
        )

    # -- status ------------------------------------------------------------------------------

    async def _record(
        self, body: Mapping[str, Any], namespace: str, name: str, statuses: list[AdapterStatus]
    ) -> None:
        new = [s.model_dump(by_alias=True, exclude_none=True, mode="json") for s in statuses]
        old = (body.get("status") or {}).get("adapters")
        if new == (old or []) and old is not None:
            return
        await self._patch(namespace, name, new)
        before = {entry.get("name"): entry.get("state") for entry in old or []}
        for status in statuses:
            if before.get(status.name) == status.state or status.state == "Pending":
                continue
            kind = "Warning" if status.state == "Failed" else "Normal"
            message = f"adapter {status.name}: {status.message}"
            await self.emit(dict(body), kind, f"Adapter{status.state}", message)

    async def _stand_down(self, body: Mapping[str, Any], namespace: str, name: str) -> None:
        """No LoRA any more: its pull Jobs and its status.adapters go."""
        await self._remove_other_jobs(namespace, name, set())
        self._refused = {k: v for k, v in self._refused.items() if k[:2] != (namespace, name)}
        if (body.get("status") or {}).get("adapters") is not None:
            await self._patch(namespace, name, None)

    async def _patch(self, namespace: str, name: str, adapters: list[Any] | None) -> None:
        try:
            await self.client.patch_status(
                LLMDEPLOYMENTS, name, {"adapters": adapters}, namespace, field_manager=FIELD_MANAGER
            )
        except ApiError as exc:
            if not exc.not_found:
                raise
