"""The cross-field rules of the spec, stated once (fleetllm.api.rules): every rule's CEL
expression, evaluated with cel-python as the API server evaluates it, agrees with its Python
predicate on the same cases; the CRD carries exactly the table; the models refuse with the
rule's error."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import celpy
import pytest
from pydantic import ValidationError

from fleetllm.api.base import SpecModel
from fleetllm.api.deployment import (
    SPEC_RULES,
    SPECULATIVE_RULES,
    GPUSpec,
    LLMDeploymentSpec,
    ModelSpec,
    SpeculativeSpec,
)
from fleetllm.api.lora import ADAPTER_RULES, LORA_RULES, AdapterSpec, LoraSpec
from fleetllm.api.rules import Rule
from fleetllm.api.scaling import MAX_HPA_DELAY_SECONDS, SCALING_RULES, ScalingSpec
from fleetllm.operator.crd import openapi_schema


def grid(**values: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Every combination of the values, by field name; None leaves an optional field out."""
    return [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]


@dataclass(frozen=True)
class Table:
    model: type[SpecModel]
    rules: tuple[Rule[Any], ...]
    cases: list[dict[str, Any]]
    """Each field at values on both sides of every rule's boundary."""
    path: str
    """Where the model sits under spec ("" for spec itself, `[]` for a list's items)."""

    def unchecked(self, fields: dict[str, Any]) -> Any:
        """The model with these fields and the defaults of the rest, its rules not checked."""
        return self.model.model_construct(**fields)


TABLES = [
    Table(
        ScalingSpec,
        SCALING_RULES,
        grid(
            min_replicas=(0, 1, 3),
            max_replicas=(1, 2),
            mode=("builtin", "keda", "hpa"),
            scale_to_zero_after_seconds=(None, 600),
            prometheus_address=(None, "http://prometheus:9090"),
            scale_down_delay_seconds=(300, MAX_HPA_DELAY_SECONDS, MAX_HPA_DELAY_SECONDS + 1),
            target_queue_time_seconds=(1.0, 0.25),
        ),
        "scaling",
    ),
    Table(
        SpeculativeSpec,
        SPECULATIVE_RULES,
        grid(num_speculative_tokens=(2,), prompt_lookup_min=(1, 2, 3), prompt_lookup_max=(1, 2)),
        "speculative",
    ),
    Table(
        LoraSpec,
        LORA_RULES,
        grid(max_loras=(1, 4, 8), max_lora_rank=(16,), max_cpu_loras=(None, 2, 4, 16)),
        "lora",
    ),
    Table(
        AdapterSpec,
        ADAPTER_RULES,
        grid(
            name=("sql",),
            source=("hf://org/sql-lora", "s3://bucket/sql", "pvc://adapters/sql", "file:///a"),
            revision=(None, "v2"),
        ),
        "adapters[]",
    ),
    Table(
        LLMDeploymentSpec,
        SPEC_RULES,
        grid(
            model=(ModelSpec(name="base", source="builtin://smollm2-135m"),),
            gpu=(GPUSpec(type="cpu"),),
            lora=(None, LoraSpec()),
            adapters=(
                [],
                [AdapterSpec(name="sql", source="file:///sql")],
                [AdapterSpec(name="base", source="file:///base")],
                [
                    AdapterSpec(name="sql", source="file:///sql"),
                    AdapterSpec(name="chat", source="file:///chat"),
                    AdapterSpec(name="sql", source="file:///sql2"),
                ],
            ),
        ),
        "",
    ),
]
each_table = pytest.mark.parametrize("table", TABLES, ids=lambda t: t.path)


def as_stored(instance: SpecModel) -> Any:
    """The object as the API server holds it when it evaluates the rules: camelCase, the
    schema's defaults applied, optional fields left out absent."""
    return celpy.json_to_cel(instance.model_dump(by_alias=True, exclude_none=True, mode="json"))


@each_table
def test_each_cel_rule_agrees_with_its_predicate(table: Table) -> None:
    env = celpy.Environment()
    programs = {rule.id: env.program(env.compile(rule.cel)) for rule in table.rules}
    seen: dict[str, set[bool]] = {rule.id: set() for rule in table.rules}
    for fields in table.cases:
        instance = table.unchecked(fields)
        stored = as_stored(instance)
        for rule in table.rules:
            holds = rule.holds(instance)
            assert bool(programs[rule.id].evaluate({"self": stored})) == holds, (rule.id, fields)
            seen[rule.id].add(holds)
    # Every rule both holds and breaks among the cases: the agreement is not vacuous.
    assert all(outcomes == {True, False} for outcomes in seen.values()), seen


@each_table
def test_the_crd_carries_the_table(table: Table) -> None:
    node = openapi_schema()["properties"]["spec"]
    if table.path:
        node = node["properties"][table.path.removesuffix("[]")]
    if table.path.endswith("[]"):
        node = node["items"]
    assert node["x-kubernetes-validations"] == [
        {"rule": rule.cel, "message": rule.message} for rule in table.rules
    ]


@each_table
def test_the_models_refuse_with_the_first_broken_rules_error(table: Table) -> None:
    for fields in table.cases:
        instance = table.unchecked(fields)
        errors = [e for rule in table.rules if (e := rule.error(instance)) is not None]
        if not errors:
            table.model.model_validate(fields)
            continue
        with pytest.raises(ValidationError) as raised:
            table.model.model_validate(fields)
        assert raised.value.errors()[0]["msg"] == f"Value error, {errors[0]}", fields


def test_a_rules_error_gives_the_values_where_it_has_them() -> None:
    (bounds,) = [r for r in SCALING_RULES if r.id == "bounds"]
    broken = ScalingSpec.model_construct(min_replicas=3, max_replicas=2)
    assert bounds.error(broken) == "minReplicas 3 exceeds maxReplicas 2"
    assert bounds.message == "minReplicas must not exceed maxReplicas"
    assert bounds.error(ScalingSpec.model_construct(min_replicas=2, max_replicas=2)) is None
