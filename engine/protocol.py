"""Request models of the engine's OpenAI-compatible API: the edge where client input is checked.

Field names, defaults and error shapes follow vLLM's OpenAI server. Fields outside a model are
kept aside (`model_extra`) for `request_fields`, which refuses vLLM's that the engine does not
serve and logs unknown ones, then ignores them as OpenAI does. Types are strict (a string is
not a number), numbers must be finite (no NaN or Infinity), integers fit in 64 bits, and each
sampling field carries its bounds, so a malformed request is answered with a 400 that names
the offending field rather than being coerced into something else, and the models' JSON
schemas (served in /openapi.json) say what is accepted.
What needs the loaded model (token ids against the vocabulary, lengths against the context) is
checked by the serving layer before anything reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from fleetllm.engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS
from fleetllm.errors import APIError, bad_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Entries of logit_bias and allowed_token_ids: each costs a little in every step's sampling.
MAX_LOGIT_RULES = 4096


def from_value_error(exc: ValueError, default_param: str | None = None) -> APIError:
    """SamplingParams and the tokenizer say "<field> must ..."; name that field as `param`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first.isidentifier() and first.islower() else default_param
    return bad_request(message, param)


Int = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]
NonEmptyStr = Annotated[Str, Field(min_length=1)]
TokenId = Annotated[Int, Field(ge=0)]  # the vocabulary's bound is the serving layer's check
Logprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]
PositiveTokens = Annotated[Int, Field(ge=1)]
BiasKey = Annotated[Str, Field(pattern=r"^[0-9]{1,19}$")]  # a token id, as OpenAI sends it
Bias = Annotated[Float, Field(ge=-100, le=100)]

_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# `prompt` is validated by `normalize_prompt` (one clear message for every wrong shape); this
# is what the schema says it takes.
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
    ]
}
_TEXT_PART_SCHEMA = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            "required": ["name"],
        },
    },
    "required": ["function"],
}
# `content` may be null (or absent) only in an assistant message with `tool_calls`.
_MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "minLength": 1},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": _TEXT_PART_SCHEMA},
                    {"type": "null"},
                ]
            },
            "tool_calls": {"type": "array", "items": _TOOL_CALL_SCHEMA},
            "tool_call_id": {"type": "string"},
        },
        "required": ["role"],
    },
}


def _nullable_optionals(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The served schema says what `_null_is_default` accepts: every optional field may be
    null."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or {"type": "null"} in prop.get("anyOf", ()):
            continue
        outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI's schema and vLLM take `null` for an optional field (`"stream": null`, as
        # some clients send every field): it means the field's default. A required field
        # given null is still refused.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class StreamOptions(OpenAIModel):
    include_usage: Bool | None = False


# -- structured outputs and tool calling (vLLM's and OpenAI's names) ------------------------
# Shapes are checked here; whether a constraint compiles is checked by the serving layer
# (serving_structured), against the model's tokenizer.
# A JSON schema, as an object or as its text.
Schema = dict[Str, Any] | Str
MAX_TOOLS = 128
MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice entries


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one constraint, and JSON options."""

    # `json` would shadow BaseModel's method of that name.
    json_schema: Schema | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[Str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: Bool | None = None
    structural_tag: NonEmptyStr | None = None
    disable_any_whitespace: Bool = False
    disable_additional_properties: Bool = False
    whitespace_pattern: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsRequest:
        kinds = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")
        given = [k.removesuffix("_schema") for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            kinds = ("json", *kinds[1:])
            raise ValueError(
                f"exactly one of {', '.join(kinds)} must be set, got {', '.join(given) or 'none'}"
            )
        return self


class JsonSchemaFormat(OpenAIModel):
    name: Str = "response"
    description: Str | None = None
    # OpenAI calls it `schema`, which pydantic's BaseModel also names a method.
    json_schema: dict[Str, Any] = Field(alias="schema")
    strict: Bool | None = None


class StructureTag(OpenAIModel):
    begin: Str
    structure_schema: dict[Str, Any] = Field(alias="schema")
    end: Str


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`, and vLLM's structural tag (its `structures` and
    `triggers` form)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructureTag] | None = None
    triggers: list[Str] | None = None

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs the 'json_schema' field")
        if self.type == "structural_tag" and (self.structures is None or self.triggers is None):
            raise ValueError("type 'structural_tag' needs 'structures' and 'triggers'")
        return self


class GuidedFields(OpenAIModel):
    """The constraint fields both generation endpoints take."""

    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older names for structured_outputs.json, .regex, .choice and .grammar.
    guided_json: Schema | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[Str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: NonEmptyStr | None = None
    guided_whitespace_pattern: NonEmptyStr | None = None


class FunctionDefinition(OpenAIModel):
    name: Annotated[Str, Field(min_length=1, max_length=256)]
    description: Str | None = None
    parameters: dict[Str, Any] | None = None
    strict: Bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: Annotated[Str, Field(min_length=1)]


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(OpenAIModel):
    """Chat's tool-calling fields."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Bool = True


class _SamplingFields(GuidedFields):
    """Fields shared by completions and chat completions; None means "the default"."""

    model: Str | None = None
    n: Annotated[Int, Field(ge=1)] = 1
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    seed: Int | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0)] | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = (
        None
    )
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: Bool = False
    ignore_eos: Bool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    skip_special_tokens: Bool = True
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    # OpenAI's shape: token ids as strings -> a bias in [-100, 100] added to their logits.
    logit_bias: Annotated[dict[BiasKey, Bias], Field(max_length=MAX_LOGIT_RULES)] | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGIT_RULES)] | None
    ) = None
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    return_token_ids: Bool = False
    prompt_logprobs: Logprobs | None = None
    # Prefix-cache blocks are shared only among requests with the same salt (vLLM's field):
    # tenants that must not learn about each other's prompts through cache timing use their own.
    cache_salt: NonEmptyStr | None = None
    # vLLM's: keep this many prompt tokens (-1: as many as leave one for the output), from
    # `truncation_side` (the tokenizer's, "right" by default: the first ones).
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # The answer's id ("cmpl-<request_id>"), as vLLM takes it.
    request_id: Annotated[NonEmptyStr, Field(max_length=256)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    # 0 only with `echo`: the prompt back, scored (lm-evaluation-harness's loglikelihood).
    max_tokens: Annotated[Int, Field(ge=0)] | None = 16
    logprobs: Logprobs | None = None
    echo: Bool = False
    suffix: Str | None = None
    add_special_tokens: Bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> list[Prompt]:
        return normalize_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def normalize_prompt(value: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of those -> a list of prompts."""
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif _is_token_ids(value):
        prompts = [value]
    elif (
        isinstance(value, list)
        and value
        and (all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value))
    ):
        prompts = list(value)
    else:
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, and must not be empty"
        )
    if any(isinstance(p, str) and not p for p in prompts):
        raise ValueError("prompt must not be empty")
    return prompts


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: Annotated[list[dict[Str, Any]], Field(min_length=1), WithJsonSchema(_MESSAGES_SCHEMA)]
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    logprobs: Bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    # The chat template writes the special tokens itself (a BOS, often): the rendered text is
    # tokenized without adding them again, as vLLM does, unless the client asks.
    add_special_tokens: Bool = False
    chat_template_kwargs: dict[Str, Any] | None = None
    # vLLM's: the last message's content leads the answer, when the answer continues it.
    echo: Bool = False
    # Given to the chat template, as vLLM does: RAG documents, and the reasoning effort (with
    # `enable_thinking`, for templates that take that instead).
    documents: list[dict[Str, Str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )


class TokenizeCompletionRequest(OpenAIModel):
    model: Str | None = None
    prompt: Str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(OpenAIModel):
    model: Str | None = None
    messages: Annotated[list[dict[Str, Any]], Field(min_length=1), WithJsonSchema(_MESSAGES_SCHEMA)]
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool = False
    chat_template_kwargs: dict[Str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # as chat renders them


class DetokenizeRequest(OpenAIModel):
    model: Str | None = None
    tokens: list[TokenId]


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; a malformed one becomes a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    err = errors[0]
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['msg']}")
    if not loc:
        return bad_request("the request body must be a JSON object")
    field = loc[0]
    # A union field fails once per member (stop: "str" and "list[str]"); say all of them.
    # Those members also name themselves in the path; leave them out of it.
    path = ".".join(str(p) for p in loc if p not in _UNION_TAGS and "[" not in str(p))
    msgs: list[str] = []
    for e in errors:
        msg = e["msg"].removeprefix("Value error, ")
        if e["loc"] and e["loc"][0] == field and msg not in msgs:
            msgs.append(msg)
    return bad_request(f"{path}: {', or '.join(msgs)}", str(field))


_UNION_TAGS = frozenset(
    {"str", "int", "float", "bool", "none", "constrained-str", "constrained-int"}
)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """/tokenize takes either a prompt or chat messages, as vLLM's does."""
    try:
        # pydantic's parser: nesting depth is bounded (json.loads would raise RecursionError).
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "messages" in data:
        return parse_request(TokenizeChatRequest, body)
    return parse_request(TokenizeCompletionRequest, body)
