"""`GET`/`PUT /admin/fleet`, enabled by an admin key: the replicas' state, and the fleet
replaced by a document of the static fleet file's form (for a supervisor that prefers HTTP)."""

from __future__ import annotations

import hmac
import time

import yaml
from aiohttp import web

from fleetllm.router.auth import bearer_token
from fleetllm.router.body import read_body
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import parse_static_fleet
from fleetllm.router.errors import RouterError
from fleetllm.router.pool import ReplicaPool


class AdminApi:
    def __init__(self, admin_key: str, pool: ReplicaPool, settings: RouterSettings) -> None:
        self.admin_key = admin_key
        self.pool = pool
        self.settings = settings

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/fleet", self.handle_get)
        app.router.add_put("/admin/fleet", self.handle_put)

    def _check_key(self, request: web.Request) -> None:
        presented = bearer_token(request.headers.get("Authorization")) or ""
        if not presented or not hmac.compare_digest(presented.encode(), self.admin_key.encode()):
            raise RouterError(401, "Incorrect or missing admin key.")

    async def handle_get(self, request: web.Request) -> web.Response:
        self._check_key(request)
        now = time.monotonic()
        models = {
            name: {
                "strategy": model.strategy,
                "held": len(model.hold),
                "replicas": [
                    {
                        "url": url,
                        "draining": p.replica.draining,
                        "up": p.replica.available(now),
                        "inFlight": p.replica.in_flight,
                        "waiting": p.replica.waiting,
                        "kvCacheUsage": p.replica.kv_usage,
                    }
                    for url, p in model.replicas.items()
                ],
            }
            for name, model in sorted(self.pool.models.items())
        }
        return web.json_response({"models": models})

    async def handle_put(self, request: web.Request) -> web.Response:
        self._check_key(request)
        body = await read_body(
            request, self.settings.max_body_bytes, self.settings.client_body_timeout
        )
        try:
            doc = yaml.safe_load(body.decode("utf-8"))
            fleet = parse_static_fleet(doc, "request body")
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise RouterError(400, f"The body is not YAML or JSON: {exc}") from None
        except RecursionError:
            raise RouterError(400, "The body is nested too deeply.") from None
        except ValueError as exc:
            raise RouterError(400, str(exc)) from None
        self.pool.apply_fleet(fleet)
        return web.json_response({"models": sorted(fleet)})
