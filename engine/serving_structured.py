"""A request's structured-output constraint, from whichever field carries it, and its compile
check: a constraint that does not compile, or is past the bounds, is a 400 naming the field.

Fields (vLLM's): `structured_outputs` (one of json, regex, choice, grammar, json_object,
structural_tag, with JSON options), `response_format` (json_object, json_schema, or a
structural tag; it replaces structured_outputs' constraint and keeps its options, as vLLM
does), and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
(`guided_whitespace_pattern` with `guided_json`). Any other mix is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from fleetllm.engine.grammar import GrammarCompiler, GrammarError
from fleetllm.engine.protocol import ChatCompletionRequest, CompletionRequest
from fleetllm.engine.sampling_params import StructuredOutputsParams
from fleetllm.errors import bad_request

GenerationRequest = CompletionRequest | ChatCompletionRequest

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclasses.dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from, named in errors


def constraint(req: GenerationRequest) -> Constraint | None:
    """The request's constraint, or None (pure)."""
    guided = [name for name in _GUIDED if getattr(req, name) is not None]
    rf = req.response_format if req.response_format and req.response_format.type != "text" else None
    so = req.structured_outputs
    given = [*guided, *(["structured_outputs"] if so else []), *(["response_format"] if rf else [])]
    if len(guided) > 1 or (guided and len(given) > 1):
        raise bad_request(
            f"{', '.join(given)}: a request takes one structured-output constraint",
            given[-1],
        )
    if guided:
        name = guided[0]
        options: dict[str, Any] = {_GUIDED[name]: getattr(req, name)}
        if req.guided_whitespace_pattern is not None:
            options["whitespace_pattern"] = req.guided_whitespace_pattern
        return Constraint(StructuredOutputsParams(**options), name)
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern applies to guided_json only", "guided_whitespace_pattern"
        )
    base = {} if so is None else _options(so.model_dump(by_alias=True))
    if rf is not None:
        return Constraint(
            StructuredOutputsParams(**base, **_from_response_format(rf)), "response_format"
        )
    if so is not None:
        kinds = {k: v for k, v in so.model_dump(by_alias=True).items() if k not in base}
        return Constraint(
            StructuredOutputsParams(**base, **{k: v for k, v in kinds.items() if v is not None}),
            "structured_outputs",
        )
    return None


def _options(fields: dict[str, Any]) -> dict[str, Any]:
    keep = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
    return {k: fields[k] for k in keep}


def _from_response_format(rf: Any) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        return {"json": rf.json_schema.json_schema}
    structures = [
        {"begin": s.begin, "schema": s.structure_schema, "end": s.end} for s in rf.structures
    ]
    return {"structural_tag": json.dumps({"structures": structures, "triggers": rf.triggers})}


async def check(compiler: GrammarCompiler, found: Constraint) -> None:
    """Compile the constraint (on a worker thread: a large one takes a fraction of a second),
    caching it for the engine; a 400 naming the field if it cannot be."""
    try:
        await asyncio.to_thread(compiler.compile, found.params)
    except GrammarError as exc:
        raise bad_request(f"{found.field}: {exc}", found.field) from None
