"""The one JSON log format, shared by the engine and the router.

Each record is one line of JSON on stderr:

    {"ts": "2026-01-02T03:04:05.678Z", "level": "info", "logger": "fleetllm.engine.server",
     "msg": "serving", "port": 8000, ...}

`ts` is UTC with milliseconds, `level` is lower case, and every key passed with
`log.info(..., extra={...})` becomes a top-level field (so `extra` keys must not be names of
`logging.LogRecord` attributes such as `name`, `msg` or `args`). A failure's traceback is in
`exc`.

Privacy by default: fields that carry request text (`TEXT_FIELDS`) are dropped unless logging was
configured with `include_text=True` (the servers' `--log-requests-text`), and fields that carry
credentials (`SECRET_FIELDS`) are always replaced by "[redacted]".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, TextIO

TEXT_FIELDS = frozenset({"prompt", "prompts", "messages", "completion", "completions"})
SECRET_FIELDS = frozenset(
    {"api_key", "admin_key", "authorization", "password", "secret", "upstream_api_key"}
)
REDACTED = "[redacted]"

# Attributes every LogRecord has, and those uvicorn adds (an ANSI-coloured copy of the message):
# not fields of our own.
_RECORD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "color_message",
    "taskName",
}


class JSONFormatter(logging.Formatter):
    converter = time.gmtime

    def __init__(self, include_text: bool = False) -> None:
        super().__init__()
        self.include_text = include_text

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _RECORD_ATTRS or key.startswith("_") or key in entry:
                continue
            if key in SECRET_FIELDS:
                entry[key] = REDACTED
            elif key not in TEXT_FIELDS or self.include_text:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


PARSER_ERROR_INTERVAL_S = 10.0
"""At most one parser-error line per this many seconds per server logger; the rest are counted."""


class ParserErrors(logging.Filter):
    """Turns the HTTP servers' reports of a request they could not parse (aiohttp logs the
    exception at ERROR, whose text quotes the raw bytes: a key or a prompt with them) into one
    WARNING line with the status and the peer and never the bytes, at most one per interval
    (a client sending garbage in a loop cannot flood the log)."""

    def __init__(self, interval: float = PARSER_ERROR_INTERVAL_S) -> None:
        super().__init__()
        self.interval = interval
        self._last = -interval
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        status = _parser_error_status(record)
        if status is None:
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._dropped += 1
            return False
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        record.__dict__.update(status=status, peer=peer, suppressed=self._dropped)
        record.msg, record.args = "malformed HTTP request refused", ()
        if record.levelno > logging.WARNING:  # a debug report (aiohttp's for non-HTTP) stays one
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        record.stack_info = None
        self._last, self._dropped = now, 0
        return True


def _parser_error_status(record: logging.LogRecord) -> int | None:
    """The status answered for a parser error record (None: not one)."""
    if record.name == "uvicorn.error" and record.msg == "Invalid HTTP request received.":
        return 400
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None or not any(c.__name__ == "HttpProcessingError" for c in type(exc).__mro__):
        return None
    code = getattr(exc, "code", 400)
    return code if isinstance(code, int) else 400


# The loggers of the HTTP servers fleetllm runs (aiohttp: the router, the local fleet;
# uvicorn: the engine).
_SERVER_LOGGERS = ("aiohttp.server", "uvicorn.error")


def filter_parser_errors() -> None:
    """Put `ParserErrors` on the loggers of the HTTP servers (once each): every process that
    serves HTTP calls this, whoever configures its handlers."""
    for name in _SERVER_LOGGERS:
        server = logging.getLogger(name)
        server.filters[:] = [f for f in server.filters if not isinstance(f, ParserErrors)]
        server.addFilter(ParserErrors())


LEVELS = ("debug", "info", "warning", "error")


def add_log_level_flag(parser: argparse._ActionsContainer) -> None:
    """The servers' common `--log-level`, whose value goes to `configure_logging`."""
    parser.add_argument("--log-level", default="info", choices=LEVELS)


def configure_logging(
    level: str = "info", *, include_text: bool = False, stream: TextIO | None = None
) -> None:
    """Send every logger's records through one JSON handler (replacing any others)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter(include_text=include_text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    filter_parser_errors()
