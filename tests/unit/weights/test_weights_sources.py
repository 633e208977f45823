"""What `fleetllm model pull` accepts as a source, without a network: a source in place needs
nothing, and the others are refused with the forms the stores expect. (A built-in model's
conversion: tests/integration/engine/test_model_pull.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetllm.weights.fetch import PullError
from fleetllm.weights.pull import pull


def test_a_source_in_place_is_not_pulled(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    assert pull("pvc://weights/llama", folder) == folder
    assert not folder.exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://x/y", "is not an hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX], pvc://"),
        ("file:///srv/llama", "is not an hf://"),
        ("hf://acme/tiny+llama", "expected hf://ORG/NAME[@REVISION]"),
        ("hf://acme/..", "expected hf://ORG/NAME[@REVISION]"),
        ("s3://Bad_Bucket/models", "'Bad_Bucket' is not an S3 bucket name"),
        ("builtin://nope", "unknown built-in model builtin://nope; built-in models: smollm2"),
    ],
)
def test_unusable_sources_are_refused_before_any_request(
    source: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(PullError, match=re.escape(message)):
        pull(source, tmp_path / "models")
    assert not (tmp_path / "models").exists()
