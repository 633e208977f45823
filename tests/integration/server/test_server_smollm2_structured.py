"""Structured outputs and tool calling on the real SmolLM2-135M-Instruct, through the server.

Every output validates against its JSON schema (jsonschema): 20 schemas, in chat and
completions, streamed and whole, with and without n-gram speculation; half the schemas greedy,
half sampled.
And the official openai client's tool loop runs end to end with the hermes parser: a tool
call (the function named, or tool_choice "required"), the tool's result, a final answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_helpers import ServerProcess, parse_sse

MODEL = "smollm2-135m"
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'

# A chatml template that shows the model its tools, hermes style, and renders tool-call
# histories (SmolLM2's own template ignores `tools`): served with --chat-template.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are a helpful assistant that can call functions. To call one, write
<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>
Functions:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


def integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def number(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def array(items: dict[str, Any], low: int, high: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
AGE = integer(0, 120)
BOOL = {"type": "boolean"}
SCHEMAS: list[dict[str, Any]] = [
    obj({"name": NAME, "age": AGE}),
    obj({"city": enum("Paris", "London", "Rome", "Berlin"), "population": AGE}),
    obj({"title": NAME, "year": integer(1900, 2030)}),
    obj({"ok": BOOL}),
    obj({"score": number(0, 10)}),
    obj({"temperature": number(-50, 50), "unit": enum("C", "F")}),
    obj({"tags": array(enum("red", "green", "blue"), 1, 3)}),
    obj({"person": obj({"first": NAME, "last": NAME})}),
    obj({"book": obj({"title": NAME, "author": obj({"name": NAME, "born": AGE})})}),
    obj({"points": array(obj({"x": AGE, "y": AGE}), 1, 2)}),
    obj({"answer": enum("yes", "no"), "confidence": number(0, 1)}),
    obj({"name": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    obj({"color": enum("red", "green"), "size": enum("S", "M", "L"), "count": AGE}),
    obj({"name": NAME, "nickname": NAME}, required=["name"]),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"matrix": array(array(integer(0, 9), 2, 2), 2, 2)}),
    obj({"status": {"const": "done"}, "steps": integer(1, 5)}),
    obj({"product": NAME, "price": number(0, 1000), "in_stock": BOOL}),
    obj({"country": NAME, "capital": NAME, "continent": enum("Europe", "Asia", "Africa")}),
    obj({"user": obj({"id": AGE, "roles": array(enum("admin", "dev"), 0, 2)})}),
]
assert len(SCHEMAS) == 20


def ask(schema: dict[str, Any]) -> str:
    return f"Reply with a JSON object following this schema: {json.dumps(schema)}"


def generate(
    server: ServerProcess, endpoint: str, schema: dict, stream: bool, sampled: bool
) -> list[str]:
    """The texts (and check each choice ended by the grammar) of one request."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 200,
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        # JSON lets a number run on forever, and a sampled 135M model will repeat a digit
        # until max_tokens ("0.99999..."): the penalty a user would set stops that.
        **(
            {"temperature": 0.8, "seed": 7, "n": 2, "frequency_penalty": 0.5}
            if sampled
            else {"temperature": 0.0}
        ),
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": ask(schema)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = ask(schema) + "\nJSON:"
        path = "/v1/completions"
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    n = body.get("n", 1)
    texts, finishes = [""] * n, [None] * n
    if stream:
        for chunk in parse_sse(response.text):
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if endpoint == "chat" else c["text"]
                texts[c["index"]] += piece or ""
                finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    else:
        for c in response.json()["choices"]:
            texts[c["index"]] = c["message"]["content"] if endpoint == "chat" else c["text"]
            finishes[c["index"]] = c["finish_reason"]
    assert finishes == ["stop"] * n, (finishes, texts)
    return texts


@pytest.fixture(scope="module")
def servers(
    launch: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    common = [
        "--model", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "2048",
        "--max-num-seqs", "64", "--num-threads", "2", "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    return {
        "plain": launch(common),
        "ngram": launch([*common, "--speculative-config", SPECULATIVE]),
    }


# 80 requests (120 outputs) on a 135M model: minutes on a 2-core CPU, more beside other work.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_every_output_validates_against_its_schema(
    servers: dict[str, ServerProcess], kind: str
) -> None:
    server = servers[kind]
    # Every schema in both endpoints, streamed and whole; greedy for half the schemas and
    # sampled (two choices) for the other half, so both decoders meet every kind of schema.
    cases = [
        (schema, endpoint, stream, i % 2 == 1)
        for i, schema in enumerate(SCHEMAS)
        for endpoint in ("chat", "completions")
        for stream in (False, True)
    ]

    def run(case: tuple[dict, str, bool, bool]) -> list[str]:
        schema, endpoint, stream, sampled = case
        return generate(server, endpoint, schema, stream, sampled)

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(zip(cases, pool.map(run, cases), strict=True))
    outputs = 0
    for (schema, *_), texts in results:
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
            outputs += 1
    assert outputs == len(cases) // 2 * 3  # greedy: one choice; sampled: two
    if kind == "ngram":  # the drafts were verified under the grammar, and some accepted
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": obj({"city": {"type": "string", "maxLength": 24}}),
    },
}


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_the_openai_clients_tool_loop_runs_end_to_end(
    servers: dict[str, ServerProcess], tool_choice: Any
) -> None:
    client = openai.OpenAI(base_url=f"{servers['plain'].base_url}/v1", api_key="-", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    # One call: a "required" list of calls could otherwise go on as long as the context.
    once = {"parallel_tool_calls": False, "max_tokens": 120}
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0,
        **once,
    )
    assert first.choices[0].message.tool_calls, first
    call = first.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    expected_finish = "stop" if tool_choice != "required" else "tool_calls"
    assert first.choices[0].finish_reason == expected_finish
    result = get_weather(**json.loads(call.function.arguments))
    messages += [
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60
    )
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls, answer
    assert answer.finish_reason in ("stop", "length")

    # The same first call streamed: a delta with the call's id and name, then its arguments
    # in pieces, which the client's stream helper assembles into the whole answer's call.
    with client.beta.chat.completions.stream(
        model=MODEL,
        messages=messages[:1],
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0,
        **once,
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)


def test_the_model_sees_its_tools_through_the_template(servers: dict[str, ServerProcess]) -> None:
    base = servers["plain"].base_url
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    tokens = httpx.post(f"{base}/tokenize", json={**body, "return_token_strs": False}).json()
    text = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    plain = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": body["messages"]})
    assert plain.json()["count"] < tokens["count"]


def test_a_served_template_that_does_not_exist_is_refused_at_start(tmp_path: Path) -> None:
    from fleetllm.tokenizer import load_chat_template

    with pytest.raises(ValueError, match="not a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not valid jinja"):
        load_chat_template("{% if %}")
