"""The API parity corpus: request bodies, valid and invalid, sent alike to the builtin engine
and to vLLM serving the same SmolLM2 (test_vllm_api_parity). One row per request; each covers
a part of vLLM's OpenAI surface: sampling and output fields, `null` for optional fields,
prompt logprobs, logit rules, fields that change the prompt, fields the engine does not serve,
the tokenizer endpoints (one BOS in a chat prompt), the model card, and the endpoints only vLLM
serves. `equal` names values that must be the same on both (dotted paths; `[]` for every item),
beyond the status class and the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "Name one colour."}]
SYSTEM = [{"role": "system", "content": "You answer in one word."}, *USER]
CONTINUED = [*USER, {"role": "assistant", "content": "The colour is"}]
PROMPT = "The three primary colours are"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"],
}
PROMPT_TOKENS = ("usage.prompt_tokens",)


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any] | None  # None: GET
    equal: tuple[str, ...] = ()


def completion(name: str, equal: tuple[str, ...] = PROMPT_TOKENS, **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **fields}
    return Case(name, "/v1/completions", body, equal)


def chat(name: str, equal: tuple[str, ...] = PROMPT_TOKENS, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0, **fields}
    return Case(name, "/v1/chat/completions", body, equal)


def raw(name: str, path: str, body: dict[str, Any] | None, *equal: str) -> Case:
    return Case(name, path, body, equal)


NO_EQUAL: tuple[str, ...] = ()

CORPUS: tuple[Case, ...] = (
    # -- completions ----------------------------------------------------------------------
    completion("cmpl-basic"),
    completion("cmpl-prompt-list", prompt=[PROMPT, "Blue is"]),
    completion("cmpl-token-ids", prompt=[504, 1345, 3893, 9368]),
    completion("cmpl-n2-seeded", n=2, temperature=0.8, seed=7),
    completion("cmpl-sampling", temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1),
    completion(
        "cmpl-penalties", presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    completion("cmpl-stop", stop=["\n", "."], include_stop_str_in_output=True),
    completion("cmpl-stop-token-ids", stop_token_ids=[2]),
    completion("cmpl-min-tokens", min_tokens=2, ignore_eos=True),
    completion("cmpl-logprobs", logprobs=2),
    completion("cmpl-echo", echo=True),
    completion(
        "cmpl-loglikelihood",
        ("usage.prompt_tokens", "choices[].logprobs.tokens", "choices[].text"),
        echo=True,
        logprobs=1,
        max_tokens=0,
    ),
    completion("cmpl-prompt-logprobs", prompt_logprobs=1),
    completion("cmpl-stream", stream=True),
    completion("cmpl-stream-usage", stream=True, stream_options={"include_usage": True}),
    completion("cmpl-stream-logprobs", stream=True, logprobs=1),
    completion(
        "cmpl-nulls",
        stream=None,
        logprobs=None,
        echo=None,
        stop=None,
        seed=None,
        temperature=None,
        user=None,
        suffix=None,
        top_p=None,
    ),
    # OpenAI's schema takes null for n; vLLM types it (and its own ignore_eos) as non-null.
    completion("cmpl-null-n", n=None),
    completion("cmpl-null-ignore-eos", ignore_eos=None),
    completion("cmpl-n2-greedy", n=2),
    # The rest of the context, cut short by the first space (a CPU replica is slow).
    completion("cmpl-max-tokens-null", max_tokens=None, stop=[" ", "\n"], prompt="Hi"),
    completion("cmpl-logit-bias", logit_bias={"504": 5.0, "1345": -100}),
    completion("cmpl-allowed-token-ids", allowed_token_ids=[504, 1345, 3893]),
    completion("cmpl-bad-words", bad_words=["red", "blue"]),
    completion("cmpl-truncate", NO_EQUAL, truncate_prompt_tokens=3),
    completion("cmpl-return-token-ids", return_token_ids=True),
    completion("cmpl-request-id", request_id="parity-1"),
    completion("cmpl-no-special-tokens", add_special_tokens=False),
    completion("cmpl-cache-salt", cache_salt="tenant-a"),
    completion("cmpl-unknown-field", frobnicate={"deep": [1, 2]}),
    completion("cmpl-vllm-defaults", use_beam_search=False, priority=0, length_penalty=1.0),
    completion("cmpl-no-prompt", NO_EQUAL, prompt=None),
    completion("cmpl-empty-prompt", NO_EQUAL, prompt=""),
    completion("cmpl-negative-temperature", NO_EQUAL, temperature=-1),
    completion("cmpl-top-p-above-one", NO_EQUAL, top_p=2),
    completion("cmpl-n-as-string", NO_EQUAL, n="2"),
    completion("cmpl-logprobs-21", NO_EQUAL, logprobs=21),
    completion("cmpl-too-long", NO_EQUAL, max_tokens=5000),
    completion("cmpl-unknown-model", NO_EQUAL, model="no-such-model"),
    completion("cmpl-bias-out-of-vocab", NO_EQUAL, logit_bias={"999999": 1}),
    completion("cmpl-token-out-of-vocab", NO_EQUAL, prompt=[999999]),
    completion("cmpl-suffix", NO_EQUAL, suffix="done."),
    completion("cmpl-truncate-past-context", NO_EQUAL, truncate_prompt_tokens=2000),
    completion("cmpl-priority", NO_EQUAL, priority=3),
    completion("cmpl-beam-search", NO_EQUAL, use_beam_search=True, n=2),
    completion("cmpl-stream-echo-logprobs", NO_EQUAL, stream=True, echo=True, logprobs=1),
    completion("cmpl-max-tokens-0-without-echo", NO_EQUAL, max_tokens=0),
    completion("cmpl-response-format-json", NO_EQUAL, response_format={"type": "json_object"}),
    completion("cmpl-structured-regex", NO_EQUAL, structured_outputs={"regex": "(red|blue)"}),
    # -- chat ------------------------------------------------------------------------------
    chat("chat-basic"),
    chat("chat-system", messages=SYSTEM),
    chat(
        "chat-content-parts",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    ),
    chat("chat-n2", n=2, temperature=0.8, seed=3),
    chat("chat-logprobs", logprobs=True, top_logprobs=2),
    chat("chat-max-completion-tokens", max_tokens=None, max_completion_tokens=2),
    chat("chat-stop", stop="\n"),
    chat("chat-stream", stream=True),
    chat("chat-stream-usage", stream=True, stream_options={"include_usage": True}),
    chat(
        "chat-stream-n2-logprobs", stream=True, n=2, logprobs=True, top_logprobs=1, temperature=0.8
    ),
    chat(
        "chat-nulls",
        stream=None,
        n=None,
        logprobs=None,
        top_logprobs=None,
        max_completion_tokens=None,
        stop=None,
        response_format=None,
        tools=None,
        seed=None,
    ),
    chat("chat-null-ignore-eos", ignore_eos=None),
    chat(
        "chat-continue",
        messages=CONTINUED,
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    chat(
        "chat-echo",
        messages=CONTINUED,
        add_generation_prompt=False,
        continue_final_message=True,
        echo=True,
    ),
    chat("chat-template-kwargs", chat_template_kwargs={"custom_flag": True}),
    chat("chat-documents", documents=[{"title": "Colours", "text": "Red is a colour."}]),
    chat("chat-reasoning-effort", reasoning_effort="low"),
    chat("chat-include-reasoning-off", include_reasoning=False),
    chat("chat-prompt-logprobs", prompt_logprobs=1),
    chat("chat-logit-bias", logit_bias={"504": 5}),
    chat("chat-allowed-token-ids", allowed_token_ids=[504, 1345, 3893]),
    chat("chat-bad-words", bad_words=["red"]),
    chat("chat-truncate", NO_EQUAL, truncate_prompt_tokens=5, truncation_side="left"),
    chat("chat-return-token-ids", return_token_ids=True),
    chat("chat-request-id", request_id="parity-2"),
    chat("chat-response-format-text", response_format={"type": "text"}),
    chat("chat-unknown-field", store=True, metadata={"k": "v"}),
    chat(
        "chat-vllm-defaults",
        use_beam_search=False,
        length_penalty=1.0,
        spaces_between_special_tokens=True,
        priority=0,
        tool_choice="none",
    ),
    chat("chat-no-messages", NO_EQUAL, messages=None),
    chat("chat-empty-messages", NO_EQUAL, messages=[]),
    chat("chat-messages-not-a-list", NO_EQUAL, messages="hello"),
    chat("chat-request-template", NO_EQUAL, chat_template="{{ messages[0]['content'] }}"),
    chat("chat-top-logprobs-alone", NO_EQUAL, top_logprobs=2),
    chat(
        "chat-continue-and-generation-prompt",
        NO_EQUAL,
        messages=CONTINUED,
        continue_final_message=True,
        add_generation_prompt=True,
    ),
    chat("chat-too-long", NO_EQUAL, max_tokens=5000),
    chat("chat-unknown-model", NO_EQUAL, model="no-such-model"),
    chat("chat-beam-search", NO_EQUAL, use_beam_search=True),
    chat("chat-stream-prompt-logprobs", NO_EQUAL, stream=True, prompt_logprobs=1),
    # Structured outputs and tool calling (see PENDING in test_vllm_api_parity).
    chat("chat-tools-none", tools=[TOOL], tool_choice="none"),
    chat("chat-tools-auto", NO_EQUAL, tools=[TOOL], tool_choice="auto"),
    chat("chat-tools-required", NO_EQUAL, tools=[TOOL], tool_choice="required"),
    chat("chat-tool-history", messages=TOOL_HISTORY, tools=[TOOL]),
    chat("chat-json-object", NO_EQUAL, response_format={"type": "json_object"}, max_tokens=8),
    chat(
        "chat-json-schema",
        NO_EQUAL,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        max_tokens=8,
    ),
    chat("chat-structured-choice", NO_EQUAL, structured_outputs={"choice": ["red", "blue"]}),
    chat("chat-guided-json", NO_EQUAL, guided_json=SCHEMA),
    # -- the tokenizer ---------------------------------------------------------------------
    raw("tok-prompt", "/tokenize", {"model": MODEL, "prompt": PROMPT}, "tokens", "count"),
    raw(
        "tok-prompt-no-special",
        "/tokenize",
        {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False},
        "tokens",
    ),
    raw("tok-chat", "/tokenize", {"model": MODEL, "messages": SYSTEM}, "tokens", "max_model_len"),
    raw(
        "tok-chat-special-tokens",
        "/tokenize",
        {"model": MODEL, "messages": USER, "add_special_tokens": True},
        "tokens",
    ),
    raw(
        "tok-chat-continue",
        "/tokenize",
        {
            "model": MODEL,
            "messages": CONTINUED,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        "tokens",
    ),
    raw(
        "tok-token-strs",
        "/tokenize",
        {"model": MODEL, "prompt": PROMPT, "return_token_strs": True},
        "tokens",
        "token_strs",
    ),
    raw("tok-no-model", "/tokenize", {"prompt": PROMPT}, "tokens"),
    raw(
        "tok-request-template",
        "/tokenize",
        {"model": MODEL, "messages": USER, "chat_template": "x"},
    ),
    raw("tok-empty-body", "/tokenize", {}),
    raw("detok", "/detokenize", {"model": MODEL, "tokens": [504, 1345, 3893]}, "prompt"),
    raw("detok-negative", "/detokenize", {"model": MODEL, "tokens": [-1]}),
    raw("detok-not-a-list", "/detokenize", {"model": MODEL, "tokens": "504"}),
    # -- the model card --------------------------------------------------------------------
    raw("models", "/v1/models", None, "data[].id", "data[].max_model_len"),
    # -- endpoints the router relays to vLLM replicas --------------------------------------
    raw("embeddings", "/v1/embeddings", {"model": MODEL, "input": PROMPT}),
    raw("pooling", "/pooling", {"model": MODEL, "input": PROMPT}),
    raw("score", "/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    raw("rerank", "/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
    raw("classify", "/classify", {"model": MODEL, "input": PROMPT}),
    raw("responses", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3}),
    raw(
        "anthropic-messages",
        "/v1/messages",
        {"model": MODEL, "messages": USER, "max_tokens": 3},
    ),
    raw("anthropic-count-tokens", "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}),
)
