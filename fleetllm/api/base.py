"""The base classes of the LLMDeployment's models: spec parts are frozen and reject unknown
fields (a typo is an error, not a silently ignored setting); status parts keep what they do
not know, since a newer operator may write more. And the pattern of every name a client puts
in a request's `model` (the model's, each adapter's)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# A served name becomes the `fleetllm.io/model` label value of every child: a label value.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
