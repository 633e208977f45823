"""The models this server answers for: the names a request may use, and /v1/models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetllm.engine.lora_adapter import LoRAAdapter
from fleetllm.engine.serving_lora import LoRARegistry
from fleetllm.errors import APIError


@dataclass(frozen=True)
class ServedModels:
    """The served names of the one loaded model, and its LoRA adapters (a request names one
    in `model`); the first name labels the metrics and answers a request that names none."""

    names: list[str]
    root: str
    """Where the model came from, as /v1/models reports it; empty: the first name."""
    created: int
    """Unix time the server started, each model card's `created`."""
    loras: LoRARegistry | None = None
    """The adapters, when LoRA is enabled."""

    def resolve(self, model: str | None) -> str:
        """The served name a request's `model` field asks for (a base name or an adapter's);
        404 for a name not served."""
        if model is None:
            return self.names[0]
        if model not in self.names and (self.loras is None or model not in self.loras.modules):
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    async def adapter(self, name: str) -> LoRAAdapter | None:
        """The adapter a resolved name runs with; None for a base name."""
        return None if self.loras is None else await self.loras.adapter(name)

    def listing(self, max_model_len: int | None) -> dict[str, Any]:
        """The /v1/models body; `max_model_len` is None while the model loads."""
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "fleetllm",
                "root": self.root or self.names[0],
                "parent": None,
                "max_model_len": max_model_len,
            }
            for name in self.names
        ]
        if self.loras is not None:
            data += self.loras.cards(self.created)
        return {"object": "list", "data": data}
