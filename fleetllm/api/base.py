"""The base classes of the LLMDeployment's models: spec parts are frozen and reject unknown
fields (a typo is an error, not a silently ignored setting); status parts keep what they do
not know, since a newer operator may write more."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
