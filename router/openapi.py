"""The router's OpenAPI document, served at /openapi.json.

It describes what the router itself checks and answers: the relayed endpoints (vLLM's
model-addressed routes, `endpoints`) need a JSON object with a string `model` (every other
field is the replica's to judge, so the document leaves them open), and every error is
OpenAI's envelope.
"""

from __future__ import annotations

from typing import Any

from fleetllm.router.endpoints import ENDPOINTS
from fleetllm.version import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}
_STRINGS = {"type": "array", "items": {"type": "string"}}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "The body is not a JSON object with a string `model`.",
        401: "No key, or not one of the router's keys.",
        403: "The key may not read this (a scoped key, the fleet's metrics).",
        404: "The model does not exist (or is outside the key's scope: the same answer).",
        408: "The body did not arrive in time.",
        413: "The body is too large.",
        429: "The key's rate limit or concurrency cap is reached.",
        500: "The replica's own answer to this request.",
        502: "The replica failed, or its answer was over the router's caps.",
        503: "No replica was ready in time, the replica is unavailable, or the router is at "
        "capacity (all clients together).",
        504: "The replica did not answer in time.",
    }
    return {str(s): _json(reasons[s], _ERROR) for s in statuses}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An answer whose body is JSON of this schema."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    """A required JSON request body of this schema."""
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


# An entry of /v1/models.
_MODEL = _object(
    {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["model"]},
        "max_model_len": {
            "type": "integer",
            "nullable": True,
            "description": "The context length its replicas serve; null until one said.",
        },
        "parent": {"type": "string", "nullable": True},
    },
    ["id", "object"],
)


def _generation(kind: str) -> dict[str, Any]:
    """A proxied endpoint: what the router needs of the body, and what may come back."""
    return {
        "post": {
            "description": f"Relayed to a replica of `model`: {kind}. The router needs only a "
            "string `model`; every other field is the replica's to check.",
            "security": [{"bearer": []}, {}],
            "requestBody": _body(
                {
                    **_object({"model": {"type": "string", "minLength": 1}}, ["model"]),
                    "additionalProperties": True,
                }
            ),
            "responses": {
                "200": {
                    "description": "The replica's answer, relayed as it came.",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                # The replica's own 4xx/5xx answers are relayed as they came too.
                **_errors(400, 401, 404, 408, 413, 429, 500, 502, 503, 504),
            },
        }
    }


def openapi_schema(admin: bool) -> dict[str, Any]:
    paths: dict[str, Any] = {e.path: _generation(e.what) for e in ENDPOINTS}
    paths |= {
        "/v1/models": {
            "get": {
                "security": [{"bearer": []}, {}],
                "responses": {
                    "200": _json(
                        "Every model of the fleet, those at zero replicas too, with the context "
                        "length its replicas report, and their LoRA adapters (each with its "
                        "model as `parent`).",
                        _object(
                            {
                                "object": {"type": "string", "enum": ["list"]},
                                "data": {"type": "array", "items": _MODEL},
                            },
                            ["object", "data"],
                        ),
                    ),
                    **_errors(401),
                },
            }
        },
        "/health": {
            "get": {
                "responses": {
                    "200": _status("The fleet is known and the router serves."),
                    "503": _status("Starting (no fleet yet) or stopping."),
                }
            }
        },
        "/metrics": {
            "get": {
                "security": [{"bearer": []}, {}],
                "responses": {
                    "200": {
                        "description": "Prometheus text, fleetllm:router_* series.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401, 403),
                },
            }
        },
        "/version": {
            "get": {
                "security": [{"bearer": []}, {}],
                "responses": {
                    **_errors(401),
                    "200": _json(
                        "The router's version.",
                        _object({"version": {"type": "string"}}, ["version"]),
                    ),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "security": [{"bearer": []}, {}],
                "responses": {
                    "200": _json("This document.", {"type": "object"}),
                    **_errors(401),
                },
            }
        },
    }
    if admin:
        paths["/admin/fleet"] = {
            "get": {
                "security": [{"bearer": []}],
                "responses": {
                    "200": _json(
                        "Each model's replicas and their state.",
                        _object({"models": {"type": "object"}}, ["models"]),
                    ),
                    **_errors(401),
                },
            },
            "put": {
                "security": [{"bearer": []}],
                "requestBody": _body(
                    {
                        "type": "object",
                        "properties": {
                            "models": {"type": "object", "additionalProperties": _STRINGS}
                        },
                    }
                ),
                "responses": {
                    "200": _json(
                        "The fleet was replaced; its model names.",
                        _object({"models": _STRINGS}, ["models"]),
                    ),
                    **_errors(400, 401, 408, 413),
                },
            },
        }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "fleetllm router",
            "version": __version__,
            "description": "One OpenAI-compatible endpoint in front of every model of the fleet.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": "string", "nullable": True},
                                "code": {"type": "integer"},
                            },
                        }
                    },
                }
            },
        },
    }


def _status(description: str) -> dict[str, Any]:
    return _json(description, _object({"status": {"type": "string"}}, ["status"]))
