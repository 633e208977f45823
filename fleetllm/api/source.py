"""A model's source (`spec.model.source`), parsed once: which scheme, where, which revision,
and the folder it takes in a model cache. The operator, the weights' pull, the engine and the
local fleet all read this one type."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

_HF = r"hf://[^/@\s]+/[^/@\s]+"
_PVC = r"pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?"
_S3 = r"s3://[^/\s]+(/\S*)?"
_FILE = r"file://\S+"
SOURCE_PATTERN = rf"^({_HF}(@[^@\s]+)?|{_PVC}|{_S3}|builtin://[-a-z0-9.]+|{_FILE})$"
ADAPTER_SOURCE_PATTERN = rf"^({_HF}|{_PVC}|{_S3}|{_FILE})$"
"""A LoRA adapter's source: no built-in adapters, and an hf:// revision in its own field."""
REVISION_PATTERN = r"^[^@\s]+$"


class ModelSource(BaseModel):
    """A parsed `spec.model.source`."""

    model_config = ConfigDict(frozen=True)

    scheme: Literal["hf", "pvc", "s3", "builtin", "file"]
    location: str
    """hf: org/name; pvc: the claim; s3: bucket/path; builtin: the model's name; file: a
    local path."""
    revision: str | None = None
    path: str = ""
    """pvc: the model's folder inside the claim."""

    @classmethod
    def parse(cls, source: str) -> ModelSource:
        if not re.match(SOURCE_PATTERN, source):
            raise ValueError(
                f"model source {source!r} is not hf://, pvc://, s3://, builtin:// or file://"
            )
        scheme, rest = source.split("://", 1)
        if scheme == "hf":
            repo, _, revision = rest.partition("@")
            return cls(scheme="hf", location=repo, revision=revision or None)
        if scheme == "pvc":
            claim, _, path = rest.partition("/")
            return cls(scheme="pvc", location=claim, path=path.strip("/"))
        return cls(scheme=scheme, location=rest)  # type: ignore[arg-type]

    @property
    def uri(self) -> str:
        """The source written out in its canonical form (what `parse` reads back)."""
        uri = f"{self.scheme}://{self.location}"
        if self.path:
            uri += f"/{self.path}"
        return f"{uri}@{self.revision}" if self.revision else uri

    @property
    def bucket(self) -> str:
        """s3: the bucket, the location's first part."""
        return self.location.partition("/")[0]

    @property
    def key_prefix(self) -> str:
        """s3: the prefix of the objects' keys in the bucket, ending in `/` (empty for the
        whole bucket)."""
        prefix = self.location.partition("/")[2].strip("/")
        return f"{prefix}/" if prefix else ""

    @property
    def downloaded(self) -> bool:
        """Whether the weights must be fetched into the pod (hf://, s3://) before loading."""
        return self.scheme in ("hf", "s3")

    def cache_key(self) -> str:
        """This source's folder in a model cache: readable, and distinct per repository and
        revision (`hf/Qwen/Qwen2.5-7B-Instruct/main`)."""
        parts = [self.scheme, *self.location.split("/")]
        if self.scheme == "hf":
            parts.append(self.revision or "main")
        return "/".join(_path_part(part) for part in parts if part)


def _path_part(part: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", part)
    return "_" if safe in (".", "..") else safe
