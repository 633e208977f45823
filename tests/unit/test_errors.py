"""The shared OpenAI error envelope."""

from __future__ import annotations

import json

import pytest

from fleetllm.errors import APIError, bad_request, default_type, error_body, error_json


def test_envelope_has_openai_fields() -> None:
    body = error_body(400, "n must be at least 1", "n")
    assert body == {
        "error": {"message": "n must be at least 1", "type": "BadRequestError", "param": "n",
                  "code": 400}
    }  # fmt: skip
    assert json.loads(error_json(400, "n must be at least 1", "n")) == body


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, "AuthenticationError"),
        (404, "NotFoundError"),
        (429, "RateLimitError"),
        (503, "ServiceUnavailableError"),
        (418, "ImATeapotError"),
        (451, "UnavailableForLegalReasonsError"),
        (499, "BadRequestError"),
        (599, "InternalServerError"),
    ],
)
def test_type_follows_the_status(status: int, kind: str) -> None:
    assert default_type(status) == kind
    assert error_body(status, "x")["error"]["type"] == kind


def test_api_error_carries_status_type_and_param() -> None:
    exc = bad_request("prompt must not be empty", "prompt")
    assert (exc.status, exc.param, exc.type, exc.client_error) == (
        400, "prompt", "BadRequestError", True
    )  # fmt: skip
    assert exc.body() == error_body(400, "prompt must not be empty", "prompt")
    assert json.loads(exc.json()) == exc.body()
    custom = APIError(502, "the replica closed the stream", type_="UpstreamError")
    assert not custom.client_error
    assert custom.body()["error"]["type"] == "UpstreamError"
    assert str(custom) == "the replica closed the stream"


def test_json_keeps_unicode_and_is_compact() -> None:
    raw = error_json(400, "stop ünïcode")
    assert "ünïcode".encode() in raw and b": " not in raw


def test_json_of_a_message_with_lone_surrogates_is_valid() -> None:
    # A client's JSON may carry "\ud800" escapes, and messages may quote the client's input.
    data = error_json(404, "The model `\ud800x` does not exist.", "model")
    assert json.loads(data)["error"]["message"] == "The model `\ud800x` does not exist."
    data.decode("utf-8")  # valid UTF-8 on the wire
