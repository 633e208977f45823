"""Tool calling for chat: how a request's `tools` and `tool_choice` shape its prompt, its
constraint and its answer, as vLLM's OpenAI server does.

- The tools go to the chat template (its `tools` variable, as transformers passes them),
  whatever the tool choice.
- `tool_choice: "auto"` (the default when tools are given) needs the server's
  `--enable-auto-tool-choice` and `--tool-call-parser`: the parser reads tool calls out of the
  model's free text. Without them the request is refused (400), as vLLM refuses it.
- `"required"` and a named function constrain the output with a JSON schema (a list of
  `{"name", "parameters"}` objects, or the function's parameters), so the model cannot answer
  otherwise; like vLLM, they need the parser flags too. They cannot be combined with another
  structured-output constraint (400).
- `parallel_tool_calls: false` keeps one call (and `required`'s schema allows only one).
- `"none"`: the text is the answer.
The finish reason is "tool_calls" when an "auto" answer called a tool or a "required" one
stopped, as in vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from fleetllm.engine import tool_parsers
from fleetllm.engine.protocol import ChatCompletionRequest, NamedToolChoice
from fleetllm.engine.sampling_params import StructuredOutputsParams
from fleetllm.engine.serving_structured import Constraint, constraint
from fleetllm.errors import bad_request


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    """The server's flags (vLLM's): a parser for "auto" tool choice, when enabled."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @property
    def parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template
    mode: str | None  # how tool calls are read: a parser, "required", "named"; None: not
    name: str | None = None  # the named function
    parallel: bool = True

    def scanner(self) -> Any:
        assert self.mode is not None
        return tool_parsers.scanner(self.mode, self.name)


def plan(req: ChatCompletionRequest, settings: ToolSettings) -> tuple[ToolPlan, Constraint | None]:
    """The request's tool plan and its structured-output constraint (the tool choice's, or
    the request's own); 400 for what cannot be honoured."""
    found = constraint(req)
    tools = req.tools
    if tools == []:
        raise bad_request("tools must not be an empty array: give one or more, or omit it", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request(
            "tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice"
        )
    rendered = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    if choice == "none":
        return ToolPlan(rendered, None), found
    names = [tool.function.name for tool in tools or ()]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(
            f"tool_choice: the function {choice.function.name!r} is not among the tools "
            f"({', '.join(names)})",
            "tool_choice",
        )
    parser = settings.parser
    if parser is None:
        what = (
            f'function "{choice.function.name}"'
            if isinstance(choice, NamedToolChoice)
            else f'"{choice}"'
        )
        raise bad_request(
            f"tool_choice={what} requires the server's --enable-auto-tool-choice and "
            "--tool-call-parser to be set",
            "tool_choice",
        )
    if choice == "auto":
        return ToolPlan(rendered, parser, parallel=req.parallel_tool_calls), found
    if found is not None:
        raise bad_request(
            f"{found.field}: a structured-output constraint cannot be combined with "
            f"tool_choice {choice if isinstance(choice, str) else 'naming a function'}",
            found.field,
        )
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools or () if t.function.name == choice.function.name)
        schema = _parameters(tool.function.parameters)
        named = ToolPlan(rendered, "named", choice.function.name, req.parallel_tool_calls)
        return named, Constraint(StructuredOutputsParams(json=schema), "tool_choice")
    schema = _required_schema(tools or [], req.parallel_tool_calls)
    required = ToolPlan(rendered, "required", parallel=req.parallel_tool_calls)
    return required, Constraint(StructuredOutputsParams(json=schema), "tools")


def _parameters(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return copy.deepcopy(parameters) if parameters else {"type": "object", "properties": {}}


def _required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a tool and giving its parameters; the
    tools' `$defs` are lifted to the top, where their references point."""
    calls, defs = [], {}
    for tool in tools:
        params = _parameters(tool.function.parameters)
        for name, definition in params.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(
                    f"tools: the definition {name!r} differs between tools' $defs", "tools"
                )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                # Only these two keys are read back: a model left free to add keys can keep
                # adding them until max_tokens.
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_call(call_id: str, call: tool_parsers.Call) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def whole_message(
    tool_plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A finished choice's assistant message and finish reason."""
    if tool_plan.mode is None:
        return {"role": "assistant", "content": text}, finish_reason
    scan = tool_plan.scanner()(text)
    calls = tool_parsers.whole_calls(scan) or []
    if not tool_plan.parallel:
        calls = calls[:1]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": scan.content or None if calls else text,
    }
    if calls:  # as vLLM and OpenAI answer: no `tool_calls` key without a call
        message["tool_calls"] = [tool_call(tool_parsers.make_call_id(), c) for c in calls]
    if tool_plan.mode in ("required", "named"):  # the output is the calls, never content
        message["content"] = ""
    return message, finished_as(tool_plan, bool(calls), finish_reason)


def finished_as(tool_plan: ToolPlan, called: bool, finish_reason: str | None) -> str | None:
    if finish_reason is None:
        return None
    if tool_plan.mode == "required" and finish_reason == "stop":
        return "tool_calls"
    if tool_plan.mode not in (None, "required", "named") and called:
        return "tool_calls"
    return finish_reason
