"""Code blocks of the docs, with the HTML comment right above each (`<!-- run by: X -->`,
`<!-- output of: COMMAND -->`), so tests can run what the docs tell readers to run and compare
what the docs say a command prints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_BLOCK = re.compile(
    r"(?:<!--\s*(?P<note>.*?)\s*-->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)\n```", re.S
)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    note: str | None
    """The comment right above the block, if any."""

    @property
    def commands(self) -> list[str]:
        """The shell commands, one per line (backslash continuations joined)."""
        return [c.strip() for c in self.body.replace("\\\n", " ").splitlines() if c.strip()]


def blocks(page: str | Path) -> list[Block]:
    text = (DOCS / page).read_text() if isinstance(page, str) else page.read_text()
    return [Block(m["lang"], m["body"], m["note"]) for m in _BLOCK.finditer(text)]


def run_by(page: str, runner: str) -> list[Block]:
    """The blocks of a page whose comment says `run by: RUNNER`."""
    return [b for b in blocks(page) if b.note and b.note.startswith(f"run by: {runner}")]
