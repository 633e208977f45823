"""LLMDeployments read from YAML or from the API, with errors that say where and which field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fleetllm.api.deployment import API_VERSION, KIND, LLMDeployment
from fleetllm.textfile import read_text


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path as users write it."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"]) or "(document)"
        lines.append(f"{path}: {err['msg']}")
    return "; ".join(lines)


def parse_llmdeployment(doc: Any, where: str = "document") -> LLMDeployment:
    """Validate one object as an LLMDeployment; errors say where and which field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(doc).__name__}")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ValueError(
            f"{where}: not an LLMDeployment (apiVersion {doc.get('apiVersion')!r}, "
            f"kind {doc.get('kind')!r}; expected {API_VERSION!r}, {KIND!r})"
        )
    try:
        return LLMDeployment.model_validate(doc)
    except ValidationError as exc:
        name = (doc.get("metadata") or {}).get("name", "?")
        raise ValueError(f"{where}: LLMDeployment {name}: {format_validation_error(exc)}") from None


def load_llmdeployments(path: str | Path) -> list[LLMDeployment]:
    """Every LLMDeployment in a (multi-document) YAML file."""
    path = Path(path)
    text = read_text(path)
    try:
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not docs:
        raise ValueError(f"{path}: no LLMDeployment in the file")
    return [
        parse_llmdeployment(doc, f"{path} (document {index})" if len(docs) > 1 else str(path))
        for index, doc in enumerate(docs, start=1)
    ]
