"""Copies each value's comment in charts/fleetllm/values.yaml into the description of its
property in values.schema.json (scripts/generate.sh runs it; a test keeps them equal), so that
the comments stay the one place a value is described and editors and `helm show` see them too.

A comment is the block of `#` lines right above a key; properties the file has no key for (the
fields of list items) keep the description written in the schema."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parents[1] / "charts" / "fleetllm"
_KEY = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*):")


def value_comments(text: str) -> dict[tuple[str, ...], str]:
    """Key path -> the comment right above that key, joined into one paragraph."""
    comments: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(line)
        if not match:
            # A blank line ends the comment block (a section's header is not its first key's).
            block = [] if not stripped else block
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if block:
            comments[tuple(k for _, k in stack)] = " ".join(block)
        block = []
    return comments


def _property(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for key in path:
        node = (node or {}).get("properties", {}).get(key)
    return node


def described(schema: dict[str, Any], comments: dict[tuple[str, ...], str]) -> dict[str, Any]:
    for path, text in comments.items():
        node = _property(schema, path)
        if node is not None:
            node["description"] = text
    return schema


def undescribed(node: dict[str, Any], path: str = "") -> list[str]:
    """Every property, at any depth (list items included), that has no description."""
    missing = []
    for key, child in node.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        if not child.get("description"):
            missing.append(here)
        missing += undescribed(child, here)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            missing += undescribed(node[key], f"{path}[]")
    return missing


def main() -> int:
    schema_path = CHART / "values.schema.json"
    schema = json.loads(schema_path.read_text())
    comments = value_comments((CHART / "values.yaml").read_text())
    schema_path.write_text(json.dumps(described(schema, comments), indent=2) + "\n")
    missing = undescribed(schema)
    for path in missing:
        sys.stderr.write(f"schema_descriptions: {path} has no comment in values.yaml\n")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
