"""The key the router shows a replica: the one derived for its LLMDeployment from the fleet's
root (`contract.engine_key`), where discovery knows which that is and a root is set, else the
static `--upstream-api-key`, else none. Requests relayed to it and the router's own reads of
its model card and adapter listings carry the same."""

from __future__ import annotations

from fleetllm.api.contract import engine_key
from fleetllm.router.config import RouterSettings
from fleetllm.router.replicas import Replica


def auth_headers(settings: RouterSettings, replica: Replica) -> dict[str, str]:
    """The Authorization header a replica requires, or none."""
    if settings.engine_key_root and replica.engine is not None:
        # This model's key only: one engine never sees another's.
        return {"Authorization": f"Bearer {engine_key(settings.engine_key_root, *replica.engine)}"}
    if settings.upstream_api_key:
        return {"Authorization": f"Bearer {settings.upstream_api_key}"}
    return {}


def replica_headers(settings: RouterSettings, replica: Replica) -> dict[str, str]:
    """A JSON request's headers to a replica, its key included."""
    return {"Content-Type": "application/json", **auth_headers(settings, replica)}
