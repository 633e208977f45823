"""The admin's policy applied to one planned LLMDeployment, the same way in the operator and in
`fleetllm render`: on the engine container as it would be rendered, so that planned images and
resources count as much as what the spec sets."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from fleetllm.api.contract import engine_key, engine_key_secret
from fleetllm.api.deployment import LLMDeployment
from fleetllm.operator.render import child_metadata, render_deployment
from fleetllm.operator.render_access import render_key_secret
from fleetllm.planner.plan import Plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.policy.check import PolicyReport, check


def review(cr: LLMDeployment, plan: Plan, config: OperatorConfig) -> PolicyReport:
    container = render_deployment(cr, plan, config)["spec"]["template"]["spec"]["containers"][0]
    # The operator's own engine images (moved to a mirror, pinned) are the admin's choice.
    own = dataclasses.astuple(config.images)
    return check(cr, config.policy, container["image"], container["resources"], own)


def new_key_secret(cr: LLMDeployment, root: str = "") -> dict[str, Any]:
    """The engine-key Secret: with the fleet's root (and the object's uid, which only the API
    server gives), the key derived from it, which the router derives too; without (`fleetllm
    render` offline, an operator run with no root), a fresh random key (256 bits)."""
    meta = cr.metadata
    if root and meta.uid and meta.namespace:
        key = engine_key(root, meta.namespace, meta.name, meta.uid)
    else:
        key = secrets.token_urlsafe(32)
    return render_key_secret(child_metadata(cr, engine_key_secret(meta.name)), key)
