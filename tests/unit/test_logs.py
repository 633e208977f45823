"""The shared JSON log format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from fleetllm.logs import REDACTED, JSONFormatter, ParserErrors, configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_one_json_object_per_line(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("info", stream=out)
    log = logging.getLogger("fleetllm.test")
    log.info("request %s", "finished", extra={"status": 200, "e2e_s": 0.25})
    log.debug("not at this level")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("step failed")
    first, second = _lines(out)
    assert first["msg"] == "request finished" and first["level"] == "info"
    assert first["logger"] == "fleetllm.test"
    assert first["status"] == 200 and first["e2e_s"] == 0.25
    ts = str(first["ts"])
    assert ts.endswith("Z") and "T" in ts and len(ts) == len("2026-01-02T03:04:05.678Z")
    assert second["level"] == "error" and "RuntimeError: boom" in str(second["exc"])


def test_text_and_secrets_stay_out_by_default(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("info", stream=out)
    fields = {"prompts": ["a secret prompt"], "completions": ["x"], "api_key": "sk-123"}
    logging.getLogger("fleetllm.test").info("request finished", extra=fields)
    (entry,) = _lines(out)
    assert "prompts" not in entry and "completions" not in entry
    assert entry["api_key"] == REDACTED
    assert "a secret prompt" not in out.getvalue() and "sk-123" not in out.getvalue()

    out = io.StringIO()
    configure_logging("info", include_text=True, stream=out)
    logging.getLogger("fleetllm.test").info("request finished", extra=fields)
    (entry,) = _lines(out)
    assert entry["prompts"] == ["a secret prompt"] and entry["api_key"] == REDACTED


def _record(
    name: str, msg: str, args: tuple[object, ...], exc: BaseException | None
) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, exc_info)


def test_parser_errors_become_one_rate_limited_warning_without_the_bytes() -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    raw = "Authorization: Bearer sk-secret\nprompt"
    parser = ParserErrors(interval=3600)
    first = _record("aiohttp.server", "Error handling request from %s", ("10.1.2.3",),
                    BadHttpMessage(raw))  # fmt: skip
    assert parser.filter(first)
    line = JSONFormatter().format(first)
    assert "sk-secret" not in line and "prompt" not in line
    entry = json.loads(line)
    assert entry["level"] == "warning" and entry["msg"] == "malformed HTTP request refused"
    assert (entry["status"], entry["peer"], entry["suppressed"]) == (400, "10.1.2.3", 0)
    # More within the interval are dropped (and counted in the next line).
    again = _record("aiohttp.server", "Error handling request from %s", ("10.1.2.3",),
                    BadHttpMessage(raw))  # fmt: skip
    assert not parser.filter(again)
    # uvicorn's (the engine's) report, and other errors, which pass as they are.
    uvicorn = ParserErrors(interval=0)
    record = _record("uvicorn.error", "Invalid HTTP request received.", (), None)
    assert uvicorn.filter(record) and record.levelno == logging.WARNING
    other = _record("aiohttp.server", "Unhandled exception", (), RuntimeError("boom"))
    assert ParserErrors().filter(other) and other.levelno == logging.ERROR and other.exc_info
