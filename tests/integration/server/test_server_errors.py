"""Malformed requests get 4xx JSON errors in OpenAI's shape and leave the server healthy;
API keys, the waiting-queue bound and the body-size limit are enforced."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import (
    MAX_MODEL_LEN,
    SERVED_NAME,
    ServerProcess,
    assert_sound,
    parse_sse,
    tiny_server_args,
    wait_until,
)

C = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
LONG_PROMPT_IDS = list(range(100, 100 + MAX_MODEL_LEN + 10))
CONTEXT_MSG = (
    f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
    f"{MAX_MODEL_LEN + 10 + 16} tokens ({MAX_MODEL_LEN + 10} in the messages, 16 in the "
    "completion). Please reduce the length of the messages or completion."
)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def _raw_completion(field: str) -> bytes:
    """A completion body with one field written as raw JSON text (NaN, Infinity, 1e999)."""
    return f'{{"model": "{SERVED_NAME}", "prompt": "hello", "max_tokens": 4, {field}}}'.encode()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": OK_MESSAGES, "max_tokens": 4, **fields}


# (id, method, path, body: JSON-able, or bytes sent as-is; status, param, message part)
MALFORMED: list[tuple[str, str, str, Any, int, str | None, str | None]] = [
    ("bad-json", "POST", C, b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("empty-body", "POST", C, b"", 400, None, "not valid JSON"),
    ("json-array", "POST", C, [1, 2], 400, None, "JSON object"),
    ("no-prompt", "POST", C, {"model": SERVED_NAME}, 400, "prompt", None),
    ("prompt-number", "POST", C, completion(prompt=123), 400, "prompt", None),
    ("prompt-empty", "POST", C, completion(prompt=""), 400, "prompt", None),
    ("prompt-empty-list", "POST", C, completion(prompt=[]), 400, "prompt", None),
    ("prompt-mixed-list", "POST", C, completion(prompt=[1, "a"]), 400, "prompt", None),
    ("prompt-token-out-of-range", "POST", C, completion(prompt=[10**9]), 400, "prompt", None),
    ("max-tokens-negative", "POST", C, completion(max_tokens=-5), 400, "max_tokens", None),
    ("max-tokens-string", "POST", C, completion(max_tokens="10"), 400, "max_tokens", None),
    ("max-tokens-float", "POST", C, completion(max_tokens=2.5), 400, "max_tokens", None),
    ("temperature-negative", "POST", C, completion(temperature=-1), 400, "temperature", None),
    ("temperature-string", "POST", C, completion(temperature="hot"), 400, "temperature", None),
    ("top-p-zero", "POST", C, completion(top_p=0), 400, "top_p", None),
    ("top-p-above-one", "POST", C, completion(top_p=1.5), 400, "top_p", None),
    ("top-k-negative", "POST", C, completion(top_k=-5), 400, "top_k", None),
    ("min-p-above-one", "POST", C, completion(min_p=2.0), 400, "min_p", None),
    ("n-zero", "POST", C, completion(n=0), 400, "n", None),
    ("logprobs-too-many", "POST", C, completion(logprobs=50), 400, "logprobs", None),
    ("stop-number", "POST", C, completion(stop=5), 400, "stop", None),
    ("stop-empty-string", "POST", C, completion(stop=[""]), 400, "stop", None),
    ("stop-token-ids-strings", "POST", C, completion(stop_token_ids=["a"]), 400,
     "stop_token_ids", None),
    ("presence-penalty-range", "POST", C, completion(presence_penalty=3), 400,
     "presence_penalty", None),
    ("repetition-penalty-zero", "POST", C, completion(repetition_penalty=0), 400,
     "repetition_penalty", None),
    ("min-tokens-over-max", "POST", C, completion(min_tokens=10), 400, "min_tokens", None),
    ("seed-string", "POST", C, completion(seed="abc"), 400, "seed", None),
    ("stream-string", "POST", C, completion(stream="yes"), 400, "stream", None),
    ("stream-options-type", "POST", C, completion(stream=True, stream_options=3), 400,
     "stream_options", None),
    ("echo-with-logprobs-streamed", "POST", C, completion(echo=True, logprobs=1, stream=True),
     400, "echo", None),
    ("max-tokens-zero-without-echo", "POST", C, completion(max_tokens=0), 400, "max_tokens",
     None),
    ("logit-bias-over-100", "POST", C, completion(logit_bias={"5": 101}), 400, "logit_bias",
     None),
    ("suffix", "POST", C, completion(suffix="tail"), 400, "suffix", None),
    ("prompt-too-long", "POST", C, completion(prompt=LONG_PROMPT_IDS, max_tokens=16), 400,
     None, CONTEXT_MSG),
    ("prompt-plus-max-tokens", "POST", C, completion(prompt="hi", max_tokens=MAX_MODEL_LEN),
     400, None, "This model's maximum context length is"),
    ("unknown-model", "POST", C, completion(model="nope"), 404, "model",
     "The model `nope` does not exist."),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), 400, "messages", None),
    ("chat-messages-string", "POST", CHAT, chat(messages="hi"), 400, "messages", None),
    ("chat-no-messages", "POST", CHAT, {"model": SERVED_NAME}, 400, "messages", None),
    ("chat-message-no-content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400,
     "messages", None),
    ("chat-role-number", "POST", CHAT, chat(messages=[{"role": 1, "content": "x"}]), 400,
     "messages", None),
    ("chat-image-part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages", None),
    ("chat-top-logprobs-alone", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("chat-top-logprobs-range", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400,
     "top_logprobs", None),
    ("chat-max-completion-zero", "POST", CHAT, chat(max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=3), 400, "logprobs", None),
    ("chat-unknown-response-format", "POST", CHAT, chat(response_format={"type": "xml"}), 400,
     "response_format", None),
    ("chat-unknown-model", "POST", CHAT, chat(model="gpt-4"), 404, "model", None),
    ("chat-too-long", "POST", CHAT,
     chat(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}], max_tokens=None),
     400, "messages", "input tokens"),
    ("tokenize-no-prompt", "POST", "/tokenize", {"model": SERVED_NAME}, 400, "prompt", None),
    ("detokenize-bad-ids", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens", None),
    ("huge-body", "POST", C, completion(prompt="x" * (9 * 1024 * 1024)), 413, None, None),
    # Each of these once killed the engine for good, answered 500, or was accepted as garbage.
    ("stop-token-id-out-of-vocab", "POST", C,
     completion(stop_token_ids=[10**6], min_tokens=2), 400, "stop_token_ids", "[0, "),
    ("stop-token-id-past-int64", "POST", C,
     completion(stop_token_ids=[2**70], min_tokens=2), 400, "stop_token_ids", None),
    ("stop-token-id-negative", "POST", C, completion(stop_token_ids=[-1]), 400,
     "stop_token_ids", None),
    ("chat-stop-token-id-out-of-vocab", "POST", CHAT, chat(stop_token_ids=[49152]), 400,
     "stop_token_ids", None),
    ("temperature-nan", "POST", C, _raw_completion('"temperature": NaN'), 400, "temperature",
     "finite"),
    ("top-p-infinity", "POST", C, _raw_completion('"top_p": Infinity'), 400, "top_p", "finite"),
    ("repetition-penalty-nan", "POST", C, _raw_completion('"repetition_penalty": NaN'), 400,
     "repetition_penalty", "finite"),
    ("presence-penalty-minus-infinity", "POST", C,
     _raw_completion('"presence_penalty": -Infinity'), 400, "presence_penalty", "finite"),
    ("frequency-penalty-overflow", "POST", C, _raw_completion('"frequency_penalty": 1e999'),
     400, "frequency_penalty", "finite"),
    ("chat-temperature-nan", "POST", CHAT,
     json.dumps(chat(temperature=float("nan"))).encode(), 400, "temperature", "finite"),
    ("seed-past-int64", "POST", C, completion(seed=2**64), 400, "seed", None),
    ("seed-below-int64", "POST", C, completion(seed=-(2**63) - 1), 400, "seed", None),
    ("max-tokens-huge", "POST", C, completion(max_tokens=2**70), 400, "max_tokens", None),
    ("top-k-huge", "POST", C, completion(top_k=2**70), 400, "top_k", None),
    ("n-huge", "POST", C, completion(n=2**70), 400, "n", None),
    ("too-many-choices", "POST", C, completion(prompt=["a"] * 129), 400, "n", "the limit is 128"),
    ("too-many-stop-strings", "POST", C, completion(stop=["x"] * 65), 400, "stop", None),
    ("prompt-token-past-int64", "POST", C, completion(prompt=[2**70]), 400, "prompt", None),
    ("chat-min-tokens-past-context", "POST", CHAT, chat(max_tokens=None, min_tokens=10**4), 400,
     "min_tokens", "maximum context length"),
    ("chat-min-over-max-completion", "POST", CHAT, chat(max_completion_tokens=2, min_tokens=5),
     400, "min_tokens", None),
    ("chat-template-kwargs-collide", "POST", CHAT,
     chat(chat_template_kwargs={"add_generation_prompt": 1}), 400, "chat_template_kwargs", None),
    ("deep-nesting", "POST", C, b'{"prompt": "x", "a": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
     400, None, "not valid JSON"),
    ("chat-deep-nesting", "POST", CHAT, b'{"messages": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
     400, None, "not valid JSON"),
    ("tokenize-deep-nesting", "POST", "/tokenize", b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5
     + b"}", 400, None, "not valid JSON"),
    ("detokenize-past-int64", "POST", "/detokenize", {"tokens": [2**70]}, 400, "tokens", None),
    ("cache-salt-empty", "POST", C, completion(cache_salt=""), 400, "cache_salt", None),
    ("cache-salt-number", "POST", C, completion(cache_salt=5), 400, "cache_salt", None),
    ("unknown-path", "GET", "/v1/nothing", None, 404, None, None),
    ("wrong-method", "GET", C, None, 405, None, None),
]  # fmt: skip


def _send(server: ServerProcess, method: str, path: str, body: Any) -> httpx.Response:
    url = f"{server.base_url}{path}"
    if body is None:
        return httpx.request(method, url, timeout=60)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.request(method, url, content=content, headers=headers, timeout=60)


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"].endswith("Error")
    assert error["code"] == status
    return error


def test_table_is_large_enough() -> None:
    assert len(MALFORMED) >= 25
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "message"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_request(
    server: ServerProcess,
    method: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    message: str | None,
) -> None:
    error = assert_error_shape(_send(server, method, path, body), status)
    if status == 400:
        assert error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param, error
    if message is not None:
        assert message in error["message"], error
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_in_flight_requests_survive_every_malformed_request(server: ServerProcess) -> None:
    """Streams running while every malformed request of the table arrives finish normally (an
    out-of-vocabulary stop token id used to fail them all and leave /health at 503)."""
    body = completion(prompt="keep going", max_tokens=200, ignore_eos=True, stream=True, n=2)
    cases = {case[0]: case[1:4] for case in MALFORMED if case[0] != "huge-body"}
    killer = cases.pop("stop-token-id-out-of-vocab")
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        streams = [
            stack.enter_context(client.stream("POST", f"{server.base_url}{C}", json=body))
            for _ in range(2)
        ]
        assert all(stream.status_code == 200 for stream in streams)
        assert _send(server, *killer).status_code == 400
        wait_until(
            lambda: server.metric("vllm:num_requests_running") == 4, what="all still generating"
        )
        statuses = [_send(server, *case).status_code for case in cases.values()]
        assert all(400 <= status < 500 for status in statuses), statuses
        for stream in streams:
            events = parse_sse(stream.read().decode())
            finished = [c for e in events for c in e["choices"] if c["finish_reason"]]
            assert [c["finish_reason"] for c in finished] == ["length"] * 2, events[-1]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_server_sound_after_malformed_requests(server: ServerProcess) -> None:
    """After the table (and anything else): no request left behind, no block leaked."""
    assert_sound(server)


def test_ignores_unknown_fields(server: ServerProcess) -> None:
    body = completion(frobnicate=True, user="someone", metadata={"a": 1})
    response = httpx.post(f"{server.base_url}{C}", json=body, timeout=60)
    assert response.status_code == 200


@pytest.fixture(scope="module")
def guarded(launch: Callable[..., ServerProcess], tiny_chat_dir: Path) -> ServerProcess:
    """One request at a time, one waiting at most, a key, a small body limit, and request
    texts in the logs."""
    args = tiny_server_args(
        tiny_chat_dir,
        "--max-num-seqs", "1",
        "--max-waiting-requests", "1",
        "--max-request-body-bytes", "4096",
        "--log-requests-text",
    )  # fmt: skip
    return launch(args, env={"FLEETLLM_API_KEY": "s3cret"})


AUTH = {"authorization": "Bearer s3cret"}


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}, {"authorization": ""}],
    ids=["none", "wrong-key", "no-scheme", "empty"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", C), ("POST", CHAT), ("GET", "/v1/models"), ("POST", "/tokenize")],
)
def test_api_key_required(
    guarded: ServerProcess, headers: dict[str, str], method: str, path: str
) -> None:
    body = chat() if path == CHAT else completion()
    response = httpx.request(
        method,
        f"{guarded.base_url}{path}",
        json=body if method == "POST" else None,
        headers=headers,
        timeout=60,
    )
    assert_error_shape(response, 401)


def test_api_key_accepted_and_probes_open(guarded: ServerProcess) -> None:
    ok = httpx.post(f"{guarded.base_url}{C}", json=completion(), headers=AUTH, timeout=60)
    assert ok.status_code == 200
    models = httpx.get(f"{guarded.base_url}/v1/models", headers=AUTH, timeout=60)
    assert models.json()["data"][0]["id"] == SERVED_NAME
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{guarded.base_url}{path}", timeout=10).status_code == 200


def test_body_limit(guarded: ServerProcess) -> None:
    big = completion(prompt="y" * 5000)
    assert_error_shape(
        httpx.post(f"{guarded.base_url}{C}", json=big, headers=AUTH, timeout=60), 413
    )

    def chunked() -> Any:  # no Content-Length: the limit is counted while reading
        for _ in range(8):
            yield b"z" * 1024

    response = httpx.post(f"{guarded.base_url}{C}", content=chunked(), headers=AUTH, timeout=60)
    assert_error_shape(response, 413)
    assert httpx.get(f"{guarded.base_url}/health", timeout=10).status_code == 200


def test_overload_answers_503(guarded: ServerProcess) -> None:
    """With one slot and a waiting bound of one, a third concurrent request is refused."""
    long = completion(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    url = f"{guarded.base_url}{C}"
    with (
        httpx.stream("POST", url, json=long, headers=AUTH, timeout=60) as first,
        httpx.stream("POST", url, json=long, headers=AUTH, timeout=60) as second,
    ):
        assert first.status_code == 200 and second.status_code == 200
        wait_until(
            lambda: (
                guarded.metric("vllm:num_requests_running") == 1
                and guarded.metric("vllm:num_requests_waiting") == 1
            ),
            what="one running, one waiting",
        )
        rejected = guarded.metric("fleetllm:engine_rejected_requests_total")
        third = httpx.post(url, json=completion(), headers=AUTH, timeout=60)
        error = assert_error_shape(third, 503)
        assert "overloaded" in error["message"]
        assert guarded.metric("fleetllm:engine_rejected_requests_total") == rejected + 1
    wait_until(
        lambda: (
            guarded.metric("vllm:num_requests_running") == 0
            and guarded.metric("vllm:num_requests_waiting") == 0
        ),
        what="both aborted",
    )
    assert httpx.post(url, json=completion(), headers=AUTH, timeout=60).status_code == 200


def test_log_requests_text(guarded: ServerProcess) -> None:
    prompt = "this prompt is logged on request"
    body = httpx.post(
        f"{guarded.base_url}{C}", json=completion(prompt=prompt), headers=AUTH, timeout=60
    ).json()

    def entry() -> dict[str, Any] | None:
        lines = (json.loads(line) for line in guarded.log_text().splitlines())
        return next((e for e in lines if e.get("request_id") == body["id"]), None)

    wait_until(lambda: entry() is not None, what="the request's log line")
    logged = entry()
    assert logged is not None
    assert logged["prompts"] == [prompt]
    assert logged["completions"] == [body["choices"][0]["text"]]


def test_a_malformed_http_request_is_one_warning_line_without_its_bytes(
    guarded: ServerProcess,
) -> None:
    """Even with request texts logged: a request the HTTP parser refuses (a header line
    without a colon) is one WARNING line, rate-limited, never its bytes (its key, its
    prompt)."""
    prompt = "the-private-prompt-of-a-malformed-request"
    body = json.dumps(completion(prompt=prompt)).encode()
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        + f"Content-Length: {len(body)}\r\nno colon {prompt}\r\n\r\n".encode()
        + body
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
            s.sendall(raw)
            assert s.recv(65536).split(b"\r\n")[0].endswith(b" 400 Bad Request")

    def refused() -> list[dict[str, Any]]:
        lines = (json.loads(line) for line in guarded.log_text().splitlines())
        return [e for e in lines if e["msg"] == "malformed HTTP request refused"]

    wait_until(lambda: bool(refused()), what="the warning")
    (line,) = refused()
    assert (line["level"], line["status"]) == ("warning", 400)
    text = guarded.log_text()
    assert "s3cret" not in text and prompt not in text
