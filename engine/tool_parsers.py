"""Tool calls read out of a model's text, whole or while it streams (pure).

Formats, chosen as vLLM chooses them:
- `hermes` (`--tool-call-parser hermes`; Hermes, Qwen, SmolLM2): text, then tool calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first tag is
  the message's content.
- `llama3_json` (`--tool-call-parser llama3_json`; Llama 3.x): an output that starts with
  `<|python_tag|>` or `{` holds JSON objects `{"name": ..., "arguments" (or "parameters"):
  {...}}`, separated by `;`; any other output is content.
- `required` (tool_choice "required", the output constrained to it): a JSON array of
  `{"name": ..., "parameters": {...}}`.
- `named` (tool_choice naming one function): the whole output is that function's arguments.

Each format scans a text that may still be growing into the content that can be shown and the
calls begun so far: a call's name once it is complete, and the raw text of its arguments so
far. As the text only grows, each call's arguments so far are a prefix of its final
arguments: a stream sends the new part of them, and the pieces add up to the `arguments` of
the whole answer (the model's own JSON text).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_WS = re.compile(r"[ \t\n\r]*")
_SCALAR_END = re.compile(r"[,}\]\s]")


@dataclass
class Call:
    """A tool call as scanned: its name (None until the name's string is complete), the raw
    text of its arguments so far, and whether the call's JSON is complete."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class Scan:
    content: str  # what is content (never a prefix of a tool-call tag)
    calls: list[Call]
    in_calls: bool  # tool calls have begun


def make_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- a scanner for JSON that may still be growing ---------------------------------------------


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends, or None if the text ends inside it."""
    if start >= len(text):
        return None
    if text[start] not in '{["':
        match = _SCALAR_END.search(text, start)
        return match.start() if match else None
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip_ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match else i


def _object_members(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object at `start`, as key -> (value start, value end or None),
    so far; and where the object ends (None if not yet)."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        key_end = _value_end(text, i)
        key = _loads(text[i:key_end]) if key_end is not None and text[i] == '"' else None
        if not isinstance(key, str):
            return members, None
        i = _skip_ws(text, key_end)  # type: ignore[arg-type]
        if i >= len(text) or text[i] != ":":
            return members, None
        i = _skip_ws(text, i + 1)
        end = _value_end(text, i)
        members[key] = (i, end)
        if end is None:
            return members, None
        i = _skip_ws(text, end)
    return members, None


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None if it is not JSON (a model may write anything)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_in_object(
    text: str, start: int, args_keys: tuple[str, ...]
) -> tuple[Call | None, int | None]:
    """The call written as a JSON object at `start` ({"name": ..., <args key>: ...}), and where
    the object ends."""
    members, end = _object_members(text, start)
    name = None
    if "name" in members and members["name"][1] is not None:
        s, e = members["name"]
        value = _loads(text[s:e])
        name = value if isinstance(value, str) else None
    key = next((k for k in args_keys if k in members), None)
    if key is None:
        return (Call(name, "", False) if name else None), end
    s, e = members[key]
    return Call(name, text[s:] if e is None else text[s:e], end is not None), end


def _calls_in_sequence(
    text: str, i: int, args_keys: tuple[str, ...], separators: str
) -> list[Call]:
    """Calls written as consecutive JSON objects from `i`, between `separators`."""
    calls: list[Call] = []
    while True:
        i = _skip_ws(text, i)
        while i < len(text) and text[i] in separators:
            i = _skip_ws(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = _call_in_object(text, i, args_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        i = end


def _held_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# -- the formats --------------------------------------------------------------------------


def scan_hermes(text: str) -> Scan:
    start = text.find(_HERMES_OPEN)
    if start == -1:
        return Scan(text[: len(text) - _held_tag(text, _HERMES_OPEN)], [], False)
    calls: list[Call] = []
    while start != -1:
        body = _skip_ws(text, start + len(_HERMES_OPEN))
        close = text.find(_HERMES_CLOSE, body)
        region = text[: close if close != -1 else len(text)]
        if body < len(region) and region[body] == "{":
            call, _ = _call_in_object(region, body, ("arguments", "parameters"))
            if call is not None:
                calls.append(call)
        start = -1 if close == -1 else text.find(_HERMES_OPEN, close)
    return Scan(text[: text.find(_HERMES_OPEN)], calls, True)


def scan_llama3_json(text: str) -> Scan:
    i = len(_PYTHON_TAG) if text.startswith(_PYTHON_TAG) else 0
    if not text[i:].startswith("{"):
        held = len(text) if _PYTHON_TAG.startswith(text) else 0  # the tag may be coming
        return Scan(text[: len(text) - held], [], False)
    return Scan("", _calls_in_sequence(text, i, ("arguments", "parameters"), ";"), True)


def scan_required(text: str) -> Scan:
    i = _skip_ws(text, 0)
    if not text[i:].startswith("["):
        return Scan("", [], True)
    return Scan("", _calls_in_sequence(text, i + 1, ("parameters",), ","), True)


def scan_named(text: str, name: str) -> Scan:
    if not text.strip():
        return Scan("", [], True)
    i = _skip_ws(text, 0)
    end = _value_end(text, i)
    return Scan("", [Call(name, text[i:] if end is None else text[i:end], end is not None)], True)


def scanner(mode: str, name: str | None = None) -> Any:
    """The scan function of a parser (`hermes`, `llama3_json`) or a tool choice (`required`,
    `named` with the function's name)."""
    if mode == "named":
        assert name is not None
        return lambda text: scan_named(text, name)
    return {"hermes": scan_hermes, "llama3_json": scan_llama3_json, "required": scan_required}[mode]


def whole_calls(scan: Scan) -> list[Call] | None:
    """A finished output's tool calls, if every call it began is complete and well formed
    (names, and arguments that are JSON objects); None otherwise (as vLLM does, the output is
    then returned as content)."""
    if not scan.calls:
        return None
    for call in scan.calls:
        if call.name is None or not call.complete:
            return None
        if not isinstance(_loads(call.arguments), dict):
            return None
    return scan.calls


@dataclass
class CallStream:
    """A streamed choice's tool calls: what each chunk adds to what was sent."""

    scan: Any  # text -> Scan
    text: str = ""
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Add a delta of text: the content to send and OpenAI's tool-call deltas (the first
        of a call carries its index, id, type and name; then pieces of its arguments)."""
        self.text += delta
        scan = self.scan(self.text)
        # At the end, nothing is held back for a tag that may be coming.
        content = self.text if final and not scan.in_calls else scan.content
        new_content = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break  # a later call cannot start before this one is named
            if index == len(self.ids):
                self.ids.append(make_call_id())
                self.sent_args.append(0)
                deltas.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            piece = call.arguments[self.sent_args[index] :]
            if piece:
                self.sent_args[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": piece}})
        return new_content, deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)
