"""The shared JSON log format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from fleetllm.logs import REDACTED, configure_logging


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
