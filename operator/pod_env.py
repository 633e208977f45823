"""The environment of an LLMDeployment's containers: who they run as and where their caches go.
Pure.

The pods run as uid RUN_AS with a read-only root filesystem. vLLM's image has no passwd entry
for that uid (it expects root): Python's getpass.getuser(), which torch's compile caches ask,
raises `KeyError: getpwuid(): uid not found` unless USER or LOGNAME names the user, and every
library's default cache folder (~/.cache, ~/.triton, /root/...) is unwritable. So the user is
named, HOME is the cache volume, and each cache folder a library reads its own variable for is
named there, for every engine (the builtin engine's images have the user; an image given in
engine.image may not).
"""

from __future__ import annotations

from typing import Any

from fleetllm.api.deployment import LLMDeployment
from fleetllm.planner.lora import lora_env

RUN_AS = 1000
# The name of RUN_AS in the project's own images (docker/*.Dockerfile).
RUN_AS_NAME = "fleetllm"
CACHE_DIR = "/var/cache/fleetllm"
"""The cache volume (an emptyDir): HOME and every cache folder are under it."""
CACHE_FOLDERS = {
    "XDG_CACHE_HOME": CACHE_DIR,
    "HF_HOME": f"{CACHE_DIR}/huggingface",
    "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "NUMBA_CACHE_DIR": f"{CACHE_DIR}/numba",
}


def base_env() -> list[dict[str, Any]]:
    """Who the container is and where its caches go (the root filesystem is read-only)."""
    identity = {"USER": RUN_AS_NAME, "LOGNAME": RUN_AS_NAME, "HOME": CACHE_DIR}
    return [{"name": name, "value": value} for name, value in (identity | CACHE_FOLDERS).items()]


def with_user_env(env: list[dict[str, Any]], cr: LLMDeployment) -> list[dict[str, Any]]:
    """`env` with spec.engine.env after it; a variable the spec also sets takes the spec's
    value (as in `fleetllm up`), and no name appears twice (server-side apply refuses that)."""
    user = [var.model_dump(by_alias=True, exclude_none=True) for var in cr.spec.engine.env]
    names = {var["name"] for var in user}
    return [var for var in env if var["name"] not in names] + user


def engine_env(cr: LLMDeployment) -> list[dict[str, Any]]:
    env = base_env()
    if cr.spec.engine.backend == "vllm":
        env += [
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "DO_NOT_TRACK", "value": "1"},
        ]
    # The load API that adapters reach the replicas through (spec.lora, not spec.adapters:
    # adding an adapter changes nothing here).
    env += [{"name": name, "value": value} for name, value in lora_env(cr.spec.lora).items()]
    return with_user_env(env, cr)
