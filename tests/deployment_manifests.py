"""LLMDeployment manifests for tests: the built-in SmolLM2 on the CPU, which every test machine
can plan and serve."""

from __future__ import annotations

from typing import Any

from fleetllm.api.deployment import API_VERSION, KIND

SMOLLM2_SOURCE = "builtin://smollm2-135m"


def smollm2(
    name: str = "smol",
    namespace: str | None = None,
    *,
    served_name: str = "smollm2-135m",
    **spec: Any,
) -> dict[str, Any]:
    """The LLMDeployment `name` serving SmolLM2 as `served_name` on the CPU; `spec` adds fields
    to its spec, or replaces these."""
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "model": {"name": served_name, "source": SMOLLM2_SOURCE},
            "gpu": {"type": "cpu"},
            **spec,
        },
    }
