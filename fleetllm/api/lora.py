"""LoRA in an LLMDeployment: `spec.lora`, the engines' adapter slots (fixed for the life of a
replica), and `spec.adapters`, the adapters served on top of the model (added and removed while
the replicas run, never restarting them).

The slots are part of the engine's command line, so changing `spec.lora` restarts the replicas
once; the adapters are loaded at run time through the engines' load API (vLLM's
`/v1/load_lora_adapter`), so that list may change freely. Hence `spec.adapters` needs
`spec.lora`: turning LoRA on is the one restart, adding the first adapter is not.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from fleetllm.api.base import MODEL_NAME_PATTERN, SpecModel
from fleetllm.api.rules import Rule, cel_validations, check
from fleetllm.api.source import ADAPTER_SOURCE_PATTERN, REVISION_PATTERN, ModelSource

LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The ranks vLLM's --max-lora-rank takes (its parser's choices); the builtin engine takes the
same, so that one spec serves on either backend."""

MAX_ADAPTERS = 128
"""Adapters one LLMDeployment lists (bounds the CEL rules' cost at the API server)."""


ADAPTER_RULES: tuple[Rule[AdapterSpec], ...] = (
    Rule(
        "revision-needs-hf",
        "!has(self.revision) || self.source.startsWith('hf://')",
        lambda a: a.revision is None or a.source.startswith("hf://"),
        "revision applies to hf:// sources only",
        detail=lambda a: (
            f"adapter {a.name}: revision applies to hf:// sources only, not {a.source}"
        ),
    ),
)


class AdapterSpec(SpecModel):
    """A LoRA adapter (PEFT's format: adapter_config.json and adapter_model.safetensors) of the
    model, served under its own name: a request whose `model` is that name runs the model with
    the adapter."""

    model_config = ConfigDict(json_schema_extra=cel_validations(ADAPTER_RULES))

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=MODEL_NAME_PATTERN,
        description="Served name of the adapter: the `model` field of OpenAI requests for it.",
    )
    source: str = Field(
        max_length=2048,
        pattern=ADAPTER_SOURCE_PATTERN,
        description="Where the adapter's files are: hf://org/name or s3://bucket/path (pulled "
        "once into the operator's model cache), pvc://claim/path (a claim the replicas mount: "
        "the model's own, or the model cache), or file://path (`fleetllm up` only; relative "
        "paths are read from the manifest's folder).",
    )
    revision: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=REVISION_PATTERN,
        description="hf:// only: the branch, tag or commit to pull (default: main).",
    )

    @model_validator(mode="after")
    def _rules(self) -> AdapterSpec:
        return check(self, ADAPTER_RULES)

    def model_source(self) -> ModelSource:
        """The source parsed as every other source is (its cache folder, its pull)."""
        parsed = ModelSource.parse(self.source)
        return parsed.model_copy(update={"revision": self.revision}) if self.revision else parsed


LORA_RULES: tuple[Rule[LoraSpec], ...] = (
    Rule(
        "cpu-loras",
        "!has(self.maxCpuLoras) || self.maxLoras <= self.maxCpuLoras",
        lambda s: s.max_cpu_loras is None or s.max_loras <= s.max_cpu_loras,
        "maxCpuLoras must not be less than maxLoras",
        detail=lambda s: f"maxCpuLoras {s.max_cpu_loras} is less than maxLoras {s.max_loras}",
    ),
)


class LoraSpec(SpecModel):
    """The engines' LoRA slots (vLLM's --enable-lora, --max-loras, --max-lora-rank,
    --max-cpu-loras). The planner reserves their memory; changing them restarts the replicas,
    adding or removing adapters does not."""

    model_config = ConfigDict(json_schema_extra=cel_validations(LORA_RULES))

    max_loras: int = Field(
        4,
        ge=1,
        le=256,
        description="Adapters one batch can mix: slots of maxLoraRank reserved in device "
        "memory. More adapters than this are served, a batch at a time.",
    )
    max_lora_rank: LoraRank = Field(
        16, description="The highest adapter rank the slots hold; a higher one fails to load."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Adapters kept loaded in host memory beyond the slots (least recently "
        "used go first, and load again from their files when asked for); defaults to maxLoras.",
    )

    @model_validator(mode="after")
    def _rules(self) -> LoraSpec:
        return check(self, LORA_RULES)

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
