"""The one client of the engines' LoRA adapter API, for the operator, the router and the local
fleet. Both backends speak vLLM's:

- `GET /v1/models` lists the model and every adapter loaded, each adapter with its `parent`;
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads one (400 when it is already
  loaded under that name; 4xx, or vLLM's 500, when it cannot be: the message says why; a
  replica without LoRA serves no such route, and its 404 says nothing of the adapter);
- `POST /v1/unload_lora_adapter {"lora_name"}` unloads one (404 when it is not loaded).

Answers are read bounded in size, and what an engine says is kept short and printable before
it reaches a status, a log line or a client. Loading and unloading are idempotent here: an
adapter found loaded (after a 400) counts as loaded, one not found as unloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import aiohttp

from fleetllm.httpread import MiB, TooLarge, read_bounded

MODELS_MAX_BYTES = MiB
"""A /v1/models listing of a model and its adapters: a few hundred bytes per entry."""
ANSWER_MAX_BYTES = 64 * 1024
MESSAGE_MAX_CHARS = 500
TRANSIENT_STATUSES = frozenset({408, 429, 502, 503, 504})
"""Answers that say nothing of the adapter: the replica is busy, starting or stopping."""


class AdapterError(Exception):
    """A load, unload or listing that did not happen. `status` is the engine's HTTP status
    (None when it did not answer); `transient` errors say nothing of the adapter itself."""

    def __init__(self, message: str, status: int | None = None, *, about_replica: bool = False):
        super().__init__(message)
        self.message = message
        self.status = status
        self._about_replica = about_replica

    @property
    def transient(self) -> bool:
        return self._about_replica or self.status is None or self.status in TRANSIENT_STATUSES


def short(text: str) -> str:
    """`text` as it may go into a status, a log or an answer: printable, bounded."""
    clean = "".join(c if c.isprintable() else " " for c in text).strip()
    return clean if len(clean) <= MESSAGE_MAX_CHARS else clean[: MESSAGE_MAX_CHARS - 3] + "..."


def _no_route(status: int, body: bytes) -> bool:
    """A 404 that is no engine's error but the web framework's: the route is not served (LoRA
    off, or runtime loading not allowed), which says nothing of the adapter. (A folder that is
    not there is vLLM's 404 too, in its error envelope.)"""
    try:
        return status == 404 and json.loads(body) == {"detail": "Not Found"}
    except (ValueError, UnicodeDecodeError):
        return False


def _message(body: bytes, status: int) -> str:
    """The error envelope's message, else the body's start, else the status."""
    try:
        doc = json.loads(body)
        message = doc["error"]["message"] if isinstance(doc.get("error"), dict) else doc["detail"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode("utf-8", "replace")
    return short(str(message)) or f"HTTP {status}"


def parse_adapters(body: bytes) -> dict[str, str]:
    """Adapter name -> its parent model, from a /v1/models body; ValueError when the body is
    not a listing."""
    doc = json.loads(body)
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError("not a model listing: no `data` list")
    found: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and name and isinstance(parent, str) and parent:
            found[name] = parent
    return found


async def list_adapters(
    session: aiohttp.ClientSession,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> dict[str, str]:
    """The adapters loaded on the replica at `url`: name -> parent."""
    try:
        async with session.get(
            url + "/v1/models",
            headers=dict(headers or {}),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            body = await read_bounded(response, MODELS_MAX_BYTES)
            if response.status != 200:
                raise AdapterError(_message(body, response.status), response.status)
    except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
        raise AdapterError(f"/v1/models: {type(exc).__name__}: {short(str(exc))}") from None
    try:
        return parse_adapters(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"/v1/models: {short(str(exc))}", 502) from None


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, str],
    headers: Mapping[str, str] | None,
    timeout: float,
) -> tuple[int, bytes]:
    try:
        async with session.post(
            url,
            json=payload,
            headers=dict(headers or {}),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            return response.status, await read_bounded(response, ANSWER_MAX_BYTES)
    except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
        raise AdapterError(f"{type(exc).__name__}: {short(str(exc))}") from None


async def load_adapter(
    session: aiohttp.ClientSession,
    url: str,
    name: str,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> None:
    """Load the adapter at `path` (a folder the replica reads) as `name` on the replica at
    `url`; AdapterError with the engine's reason when it is not loaded after."""
    payload = {"lora_name": name, "lora_path": path}
    status, body = await _post(session, url + "/v1/load_lora_adapter", payload, headers, timeout)
    if status == 200:
        return
    if _no_route(status, body):
        raise AdapterError(
            "the replica serves no adapter load API (LoRA is off there)", 404, about_replica=True
        )
    error = AdapterError(_message(body, status), status)
    if status == 400:
        # Loaded already (by another of its loaders, or before a lost answer): done, if the
        # listing says so; otherwise the 400 is the engine's verdict on the adapter.
        try:
            loaded = await list_adapters(session, url, headers=headers)
        except AdapterError:
            raise error from None
        if name in loaded:
            return
    raise error


async def unload_adapter(
    session: aiohttp.ClientSession,
    url: str,
    name: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> None:
    """Unload `name` from the replica at `url` (done when it is not loaded there)."""
    payload = {"lora_name": name}
    status, body = await _post(session, url + "/v1/unload_lora_adapter", payload, headers, timeout)
    if status not in (200, 404):
        raise AdapterError(_message(body, status), status)
