"""What `fleetllm model pull` accepts as a source, without a network: sources in place need
nothing, and the others are refused with the forms the stores expect."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetllm.weights.fetch import PullError
from fleetllm.weights.pull import pull


@pytest.mark.parametrize("source", ["pvc://weights/llama", "builtin://smollm2-135m"])
def test_a_source_in_place_is_not_pulled(source: str, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    assert pull(source, folder) == folder
    assert not folder.exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://x/y", "is not an hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX], pvc://"),
        ("file:///srv/llama", "is not an hf://"),
        ("hf://acme/tiny+llama", "expected hf://ORG/NAME[@REVISION]"),
        ("hf://acme/..", "expected hf://ORG/NAME[@REVISION]"),
        ("s3://Bad_Bucket/models", "'Bad_Bucket' is not an S3 bucket name"),
    ],
)
def test_unusable_sources_are_refused_before_any_request(
    source: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(PullError, match=re.escape(message)):
        pull(source, tmp_path / "models")
    assert not (tmp_path / "models").exists()
