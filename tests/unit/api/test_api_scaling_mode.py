"""The one property that says whether the builtin autoscaler drives an LLMDeployment."""

from __future__ import annotations

from typing import Any

import pytest

from fleetllm.api.deployment import LLMDeploymentSpec

SPEC = {"model": {"name": "smol", "source": "builtin://smollm2-135m"}, "gpu": {"type": "cpu"}}
PROMETHEUS = "http://prometheus:9090"


@pytest.mark.parametrize(
    ("scaling", "builtin"),
    [
        (None, False),
        ({"maxReplicas": 2}, True),
        ({"maxReplicas": 2, "mode": "builtin"}, True),
        ({"maxReplicas": 2, "mode": "hpa"}, False),
        ({"maxReplicas": 2, "mode": "keda", "prometheusAddress": PROMETHEUS}, False),
    ],
)
def test_autoscaled_by_builtin(scaling: dict[str, Any] | None, builtin: bool) -> None:
    spec = LLMDeploymentSpec.model_validate(
        SPEC if scaling is None else {**SPEC, "scaling": scaling}
    )
    assert spec.autoscaled_by_builtin is builtin
