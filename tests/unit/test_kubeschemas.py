"""The tests' schema check (tests/kubeschemas.py) gives kubernetes_validate's own verdicts:
the same objects pass, and the same error (path, message, schema version) fails the rest."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import kubeschemas
import pytest
from examples import ALL_EXAMPLES

from fleetllm.api.manifests import load_llmdeployments
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan


def _verdict(
    validate: Callable[[dict[str, Any], str], Any], obj: dict[str, Any], version: str
) -> tuple[Any, ...]:
    try:
        validate(obj, version)
    except kubernetes_validate.ValidationError as exc:
        return ("invalid", list(exc.path), exc.message, exc.version, list(exc.schema_path))
    except kubernetes_validate.SchemaNotFoundError as exc:
        return ("no schema", exc.message)
    return ("valid",)


def _objects() -> list[dict[str, Any]]:
    cr = load_llmdeployments(ALL_EXAMPLES[0])[0]
    meta = cr.metadata.model_copy(update={"namespace": cr.metadata.namespace or "default"})
    objects = render(cr.model_copy(update={"metadata": meta}), plan(cr.spec))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    wrong_port = copy.deepcopy(deployment)
    wrong_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    unknown_field = copy.deepcopy(deployment)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["probe"] = {}
    unknown_kind = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    return [*objects, wrong_port, unknown_field, unknown_kind]


@pytest.mark.parametrize("version", ["1.30", "v1.37"])
def test_every_verdict_is_the_librarys(version: str) -> None:
    def library(obj: dict[str, Any], version: str) -> Any:
        return kubernetes_validate.validate(obj, version, strict=True)

    verdicts = [
        (_verdict(library, obj, version), _verdict(kubeschemas.validate, obj, version))
        for obj in _objects()
    ]
    assert all(ours == theirs for theirs, ours in verdicts), verdicts
    kinds = {theirs[0] for theirs, _ in verdicts}
    assert kinds == {"valid", "invalid", "no schema"}
