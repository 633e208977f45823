"""Reading a file a user names (a manifest, a fleet file), with errors that name the file."""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path) -> str:
    """The file's text (UTF-8). FileNotFoundError when it does not exist, ValueError when it
    cannot be read (a folder, no permission, not UTF-8): both say which file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
