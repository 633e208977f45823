"""vLLM's request fields that shape the prompt or the answer, over HTTP: the chat template gets
`documents` and `reasoning_effort`, `echo` leads a continued message with its content,
`truncate_prompt_tokens` keeps the tokens vLLM keeps, `request_id` names the answer, and fields
the engine does not serve are refused by name, while unknown ones are ignored and logged once,
without their value."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from server_helpers import SERVED_NAME, ServerProcess, assert_sound, parse_sse, post
from server_helpers import tiny_server_args as server_args
from tinymodels import write_tiny_chat_model

# SmolLM2's template, which also writes the documents and the reasoning switches it is given.
TEMPLATE = (
    "{% for d in documents or [] %}<doc>{{ d['title'] }}: {{ d['text'] }}</doc>\n{% endfor %}"
    "{% if reasoning_effort is defined %}<effort>{{ reasoning_effort }}</effort>\n{% endif %}"
    "{% if enable_thinking is defined %}<think>{{ enable_thinking }}</think>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Where is my parcel?"}]
PROMPT = "The parcel left the depot on Monday and reached the sorting centre on"


@pytest.fixture(scope="module")
def server(
    launch: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    path = write_tiny_chat_model(tmp_path_factory.mktemp("fields-chat"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return launch(server_args(path))


def chat(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 3, **fields}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_ids(server: ServerProcess, **fields: Any) -> list[int]:
    """The prompt generation used, as the engine reports it."""
    return list(chat(server, return_token_ids=True, **fields)["prompt_token_ids"])


def ids_of(server: ServerProcess, text: str) -> list[int]:
    body = {"model": SERVED_NAME, "prompt": text, "add_special_tokens": False}
    return list(post(server, "/tokenize", body).json()["tokens"])


def test_documents_and_reasoning_effort_reach_the_chat_template(server: ServerProcess) -> None:
    turn = "<|im_start|>user\nWhere is my parcel?<|im_end|>\n<|im_start|>assistant\n"
    docs = [{"title": "Tracking", "text": "Parcel 7 is in Lyon."}]
    assert prompt_ids(server) == ids_of(server, turn)
    assert prompt_ids(server, documents=docs) == ids_of(
        server, "<doc>Tracking: Parcel 7 is in Lyon.</doc>\n" + turn
    )
    assert prompt_ids(server, reasoning_effort="low") == ids_of(
        server, "<effort>low</effort>\n<think>True</think>\n" + turn
    )
    assert prompt_ids(server, reasoning_effort="none", chat_template_kwargs={"x": 1}) == ids_of(
        server, "<effort>none</effort>\n<think>False</think>\n" + turn
    )
    bad = post(server, "/v1/chat/completions", {"messages": MESSAGES, "documents": "a doc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    bad = post(server, "/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "huge"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_echo_leads_a_continued_message_with_its_content(server: ServerProcess) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "It is in"}]
    continued = {"messages": messages, "add_generation_prompt": False}
    continued |= {"continue_final_message": True, "temperature": 0}
    plain = chat(server, **continued)["choices"][0]["message"]
    echoed = chat(server, echo=True, **continued)["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "It is in" + plain["content"]}

    body = {"model": SERVED_NAME, "max_tokens": 3, "stream": True, "echo": True, **continued}
    response = post(server, "/v1/chat/completions", body)
    events = parse_sse(response.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "It is in"}
    assert "".join(d.get("content", "") for d in deltas) == echoed["content"]

    # A user's last message is not the answer's: nothing is echoed.
    assert (
        chat(server, echo=True, temperature=0)["choices"][0]["message"]["content"]
        == chat(server, temperature=0)["choices"][0]["message"]["content"]
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_keeps_the_tokens_vllm_keeps(
    server: ServerProcess, path: str
) -> None:
    base: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 4, "temperature": 0}
    base |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    full = post(server, path, {**base, "return_token_ids": True}).json()
    ids = full.get("prompt_token_ids") or full["choices"][0]["prompt_token_ids"]
    keep = len(ids) // 2
    for side, kept in (("left", ids[-keep:]), ("right", ids[:keep]), (None, ids[:keep])):
        body = {**base, "truncate_prompt_tokens": keep, "truncation_side": side}
        cut = post(server, path, {**body, "return_token_ids": True}).json()
        assert cut["usage"]["prompt_tokens"] == keep
        assert (cut.get("prompt_token_ids") or cut["choices"][0]["prompt_token_ids"]) == kept
        # The same answer as for those tokens sent as the prompt.
        same = post(
            server,
            "/v1/completions",
            {"model": SERVED_NAME, "prompt": kept, "max_tokens": 4, "temperature": 0},
        ).json()
        answer = cut["choices"][0]
        assert (
            answer.get("text", answer.get("message", {}).get("content"))
            == same["choices"][0]["text"]
        )
    untouched = post(server, path, {**base, "truncate_prompt_tokens": len(ids) + 5}).json()
    assert untouched["usage"]["prompt_tokens"] == len(ids)
    for keep, status in ((0, 400), (10_000, 400), (-2, 400)):
        r = post(server, path, {**base, "truncate_prompt_tokens": keep})
        assert r.status_code == status and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = post(server, path, {**base, "truncate_prompt_tokens": 4, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


def test_request_id_names_the_answer(server: ServerProcess) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2, "request_id": "order-42"}
    first = post(server, "/v1/completions", body)
    again = post(server, "/v1/completions", body)  # the same id twice is the client's to give
    assert first.json()["id"] == again.json()["id"] == "cmpl-order-42"
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    assert {e["id"] for e in parse_sse(streamed.text)} == {"cmpl-order-42"}
    assert chat(server, request_id="c-1")["id"] == "chatcmpl-c-1"
    assert chat(server)["id"].startswith("chatcmpl-")


def test_unserved_fields_are_refused_by_name_and_unknown_ones_logged_once(
    server: ServerProcess,
) -> None:
    secret = "sk-do-not-log-this-value"
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True}),
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ messages }}"}),
        ("/v1/completions", {"prompt": PROMPT, "priority": 3}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_embeds": "AAAA"}),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "x"}),
    ):
        r = post(server, path, {"model": SERVED_NAME, **body})
        name = next(k for k in body if k not in ("messages", "prompt"))
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text

    # Defaults are taken, as clients that send every field send them.
    defaults = {"use_beam_search": False, "priority": 0, "length_penalty": 1.0}
    defaults |= {"spaces_between_special_tokens": True, "session_id": "s-1"}
    assert chat(server, **defaults)["usage"]["completion_tokens"] == 3

    for _ in range(3):
        chat(server, store=secret, metadata={"order": secret}, seed_phrase=None)
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    unknown = [line for line in lines if line.get("msg") == "unknown request field ignored"]
    assert sorted(line["field"] for line in unknown) == ["metadata", "seed_phrase", "store"]
    assert {line["level"] for line in unknown} == {"warning"}
    assert secret not in server.log_text()
    assert_sound(server)
