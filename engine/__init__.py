"""fleetllm's inference engine: paged KV cache, continuous batching, offline and step APIs.

The public names load on first use, so that importing a sibling module (the CLI, say) does
not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "fleetllm.engine.llm",
    "LLMEngine": "fleetllm.engine.engine",
    "EngineConfig": "fleetllm.engine.config",
    "SamplingParams": "fleetllm.engine.sampling_params",
    "RequestOutput": "fleetllm.engine.request",
    "CompletionOutput": "fleetllm.engine.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fleetllm.engine' has no attribute {name!r}")
