"""The LoRA adapters a server serves by name: vLLM's `--lora-modules`, its runtime
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` with its answers, and the CPU cache of
adapter weights (`--max-cpu-loras`).

An adapter is registered under a name with its folder; its weights (checked, on the CPU) stay
in a least-recently-used cache of `max_cpu_loras` adapters, and one evicted from it is read
again when a request names it. Reading and checking an adapter happens on a worker thread,
never on the event loop nor on the engine's step loop; a request holds its adapter's weights
until it ends, so eviction never takes them from under a running request. Unloading removes the
name: requests already running with it finish, new ones get 404.

Runtime loading is vLLM's development feature, on only where the environment says
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (or true), as vLLM gates it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from fleetllm.engine.lora_adapter import LoRAAdapter, LoRAAdapterNotFoundError, check_path
from fleetllm.errors import APIError, bad_request

log = logging.getLogger("fleetllm.engine.lora")

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_NAME_CHARS = 256


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModule:
    """`name=path` (no comma), or `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoRAModule(name, path)
    try:
        value = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"--lora-modules: invalid JSON: {item}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {item}")
    if value.get("is_3d_lora_weight"):
        raise ValueError("--lora-modules: is_3d_lora_weight (MoE adapters) is not supported")
    value.pop("is_3d_lora_weight", None)
    unknown = sorted(set(value) - {"name", "path", "base_model_name"})
    if unknown or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
        raise ValueError(
            f"--lora-modules: {item} needs string fields name and path, and may have "
            f"base_model_name{f'; unknown fields: {unknown}' if unknown else ''}"
        )
    base = value.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules: base_model_name must be a string in {item}")
    return LoRAModule(value["name"], value["path"], base)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


# (adapter name, folder) -> the checked adapter; raises LoRAAdapterError, a ValueError, or
# LoRAAdapterNotFoundError. Runs on a worker thread.
Loader = Callable[[str, str], LoRAAdapter]


class LoRARegistry:
    def __init__(
        self, base_names: list[str], max_cpu_loras: int, allowed_roots: list[Path] | None = None
    ) -> None:
        """`allowed_roots`: the folders runtime loads may read adapters from (None: any)."""
        self.base_names = base_names
        self.max_cpu_loras = max_cpu_loras
        self.allowed_roots = allowed_roots
        self.modules: dict[str, LoRAModule] = {}  # by name, in load order
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        # One lock for every change and every read from disk: they are rare, and one lock
        # bounds the threads reading adapters to one.
        self._lock = asyncio.Lock()
        self.loader: Loader | None = None  # set once the engine is loaded

    # -- names ---------------------------------------------------------------------------

    def parent(self, module: LoRAModule) -> str:
        return module.base_model_name or self.base_names[0]

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, as vLLM writes them."""
        return [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "fleetllm",
                "root": m.path,
                "parent": self.parent(m),
                "max_model_len": None,
            }
            for m in self.modules.values()
        ]

    def check_name(self, name: str) -> None:
        if not name:
            raise bad_request("lora_name must not be empty", "lora_name")
        if len(name) > MAX_NAME_CHARS or "," in name or not name.isprintable():
            raise bad_request(
                f"lora_name must be at most {MAX_NAME_CHARS} printable characters without "
                "commas (the metric vllm:lora_requests_info lists names separated by commas)",
                "lora_name",
            )
        if name in self.base_names:
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model.")

    # -- loading -----------------------------------------------------------------------------

    def add_static(self, module: LoRAModule) -> None:
        """Load one `--lora-modules` entry now (at start-up, before the server is ready)."""
        try:
            self.check_name(module.name)
        except APIError as exc:
            raise ValueError(f"--lora-modules: {exc.message}") from None
        if module.base_model_name is not None and module.base_model_name not in self.base_names:
            raise ValueError(
                f"--lora-modules: base_model_name {module.base_model_name!r} of "
                f"{module.name!r} is not a served model name ({', '.join(self.base_names)})"
            )
        if module.name in self.modules:
            raise ValueError(f"--lora-modules: {module.name!r} is given twice")
        assert self.loader is not None
        try:
            adapter = self.loader(module.name, module.path)
        except (ValueError, LoRAAdapterNotFoundError) as exc:
            raise ValueError(f"--lora-modules: {module.name}: {exc}") from None
        self._add(module, adapter)

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter; vLLM's answers."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if request.is_3d_lora_weight:
            raise bad_request(
                "is_3d_lora_weight (MoE adapters) is not supported", "is_3d_lora_weight"
            )
        self.check_name(name)
        try:
            check_path(path, self.allowed_roots)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        async with self._lock:
            if name in self.modules and not request.load_inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            adapter = await self._read(name, path)
            self._add(LoRAModule(name, path), adapter)
        log.info("loaded LoRA adapter", extra={"lora_name": name, "lora_path": path})
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """POST /v1/unload_lora_adapter; vLLM's answers."""
        name = request.lora_name
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        if request.lora_int_id is not None:
            raise bad_request(
                "lora_int_id is not used here: adapters are unloaded by lora_name", "lora_int_id"
            )
        async with self._lock:
            if name not in self.modules:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.")
            del self.modules[name]
            self._cache.pop(name, None)
        log.info("unloaded LoRA adapter", extra={"lora_name": name})
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def adapter(self, name: str) -> LoRAAdapter | None:
        """The weights of adapter `name` for a request (None: a base model's name); read again
        from its folder when the CPU cache let them go."""
        if name not in self.modules:
            return None
        cached = self._cache.get(name)
        if cached is not None:
            self._cache.move_to_end(name)
            return cached
        async with self._lock:
            module = self.modules.get(name)
            if module is None:  # unloaded meanwhile
                raise APIError(404, f"The model `{name}` does not exist.", "model")
            if name not in self._cache:
                self._add(module, await self._read(name, module.path))
            return self._cache[name]

    async def _read(self, name: str, path: str) -> LoRAAdapter:
        if self.loader is None:
            raise APIError(503, "the model is still loading")
        try:
            return await asyncio.to_thread(self.loader, name, path)
        except LoRAAdapterNotFoundError as exc:
            raise APIError(404, str(exc)) from None
        except ValueError as exc:
            raise bad_request(f"LoRA adapter '{name}' cannot be loaded: {exc}") from None

    def _add(self, module: LoRAModule, adapter: LoRAAdapter) -> None:
        self.modules[module.name] = module
        self._cache[module.name] = adapter
        self._cache.move_to_end(module.name)
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)
