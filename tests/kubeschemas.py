"""Objects checked against the Kubernetes JSON schemas that kubernetes_validate ships, as its
`validate(obj, version, strict=True)` checks them, with each kind's validator made once: the
library reads and parses its schema files (megabytes of JSON) on every call, which was most
of the time of the tests that check many objects."""

from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
from kubernetes_validate import SchemaNotFoundError, ValidationError
from kubernetes_validate import utils as library
from kubernetes_validate.utils import VersionNotSupportedError
from referencing import Registry, Resource


def validate(obj: dict[str, Any], version: str) -> None:
    """Raise the library's ValidationError (SchemaNotFoundError for a kind it has no schema
    of) where `kubernetes_validate.validate(obj, version, strict=True)` would."""
    validator, schemas = _validator(
        library.major_minor(version.removeprefix("v")), obj["apiVersion"], obj["kind"]
    )
    try:
        validator.validate(obj)
    except jsonschema.ValidationError as exc:
        raise ValidationError(exc, version=schemas) from None


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> tuple[Any, str]:
    """The validator of one kind, and the Kubernetes version of its schemas."""
    # As the library: the newest schemas not newer than `version`; the API group without its
    # domain (rbac.authorization.k8s.io/v1 -> rbac-v1).
    if version > library.latest_version():
        raise VersionNotSupportedError(version=version)
    found = [v for v in library.all_versions() if library.major_minor(v) <= version][-1]
    folder = f"kubernetes-json-schema/v{found}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = library.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        raise SchemaNotFoundError(version=version, kind=kind, api_version=api_version) from None
    definitions = library.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry), library.major_minor(found)
