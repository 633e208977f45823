"""The models this server answers for: the names a request may use, and /v1/models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetllm.errors import APIError


@dataclass(frozen=True)
class ServedModels:
    """The served names of the one loaded model; the first labels the metrics and answers a
    request that names none."""

    names: list[str]
    root: str
    """Where the model came from, as /v1/models reports it; empty: the first name."""
    created: int
    """Unix time the server started, each model card's `created`."""

    def resolve(self, model: str | None) -> str:
        """The served name a request's `model` field asks for; 404 for a name not served."""
        if model is None:
            return self.names[0]
        if model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

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
        return {"object": "list", "data": data}
