"""A file a user names reads with errors that name it, for manifests and fleet files alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fleetllm.api.manifests import load_llmdeployments
from fleetllm.router.discovery import load_static_fleet
from fleetllm.textfile import read_text


@pytest.mark.parametrize("load", [read_text, load_llmdeployments, load_static_fleet])
def test_unreadable_files_are_named(load: Callable[[Path], object], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'gone.yaml'}: no such file"):
        load(tmp_path / "gone.yaml")
    with pytest.raises(ValueError, match=f"{tmp_path}: cannot read"):
        load(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=f"{binary}: cannot read"):
        load(binary)


def test_text_is_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("name: café\n", encoding="utf-8")
    assert read_text(path) == "name: café\n"
