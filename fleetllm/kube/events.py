"""core/v1 Events, as `kubectl describe` shows them. Pure: the caller creates the object."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Literal

EVENT_MESSAGE_LIMIT = 1024

EventType = Literal["Normal", "Warning"]


def event_about(
    involved: Mapping[str, Any],
    *,
    type: EventType,
    reason: str,
    message: str,
    component: str,
    instance: str,
    now: datetime.datetime,
    action: str | None = None,
) -> dict[str, Any]:
    """An Event about `involved` (an object as read from the API), in its namespace ("default"
    for a cluster-scoped one), reported by `component` running as `instance` (its host)."""
    meta = involved.get("metadata") or {}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    event: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{meta.get('name', 'object')}.",
            "namespace": meta.get("namespace") or "default",
        },
        "involvedObject": {
            key: value
            for key, value in {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            }.items()
            if value
        },
        "type": type,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "count": 1,
    }
    if action:
        event["action"] = action
    return event
