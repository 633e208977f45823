"""Cross-field rules of a spec part, each stated once: the CEL expression the API server
evaluates (the CRD's `x-kubernetes-validations`, so `kubectl apply` refuses a bad spec) and the
predicate the models check (so `fleetllm up` and the operator refuse it too), with the message
both give. A test evaluates every CEL expression against the same cases as its predicate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from pydantic.alias_generators import to_snake

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Rule(Generic[M]):
    id: str
    cel: str
    """Over the spec part as the API server holds it (`self`, camelCase, defaults applied)."""
    holds: Callable[[M], bool]
    """The same rule over the model."""
    message: str
    """What the API server answers when it is broken."""
    detail: Callable[[M], str] | None = None
    """The models' error, with the values, where it says more than `message`."""

    def error(self, model: M) -> str | None:
        """Why `model` breaks the rule; None when it holds."""
        if self.holds(model):
            return None
        return self.detail(model) if self.detail is not None else self.message


def ordered(rule_id: str, low: str, high: str) -> Rule[Any]:
    """Field `low` must not exceed field `high` of the same part (camelCase names)."""
    low_attr, high_attr = to_snake(low), to_snake(high)
    return Rule(
        rule_id,
        f"self.{low} <= self.{high}",
        lambda m: getattr(m, low_attr) <= getattr(m, high_attr),
        f"{low} must not exceed {high}",
        detail=lambda m: f"{low} {getattr(m, low_attr)} exceeds {high} {getattr(m, high_attr)}",
    )


def cel_validations(rules: Sequence[Rule[Any]]) -> dict[str, Any]:
    """The rules as a JSON Schema extra: the CRD's `x-kubernetes-validations`."""
    return {"x-kubernetes-validations": [{"rule": r.cel, "message": r.message} for r in rules]}


def check(model: M, rules: Sequence[Rule[M]]) -> M:
    """`model` if it keeps every rule; else a ValueError for the first one it breaks."""
    for rule in rules:
        error = rule.error(model)
        if error is not None:
            raise ValueError(error)
    return model
