"""One parse of a model source, and what the operator, the pull and the local fleet read of it."""

from __future__ import annotations

import pytest

from fleetllm.api.source import ModelSource


@pytest.mark.parametrize(
    "text",
    [
        "hf://Qwen/Qwen2.5-7B-Instruct",
        "hf://Qwen/Qwen2.5-7B-Instruct@0123456789abcdef0123456789abcdef01234567",
        "pvc://weights",
        "pvc://weights/llama/8b",
        "s3://bucket",
        "s3://bucket/models/llama",
        "builtin://smollm2-135m",
        "file:///srv/llama",
    ],
)
def test_the_canonical_form_reads_back_the_same(text: str) -> None:
    source = ModelSource.parse(text)
    assert source.uri == text
    assert ModelSource.parse(source.uri) == source


def test_parts_of_each_scheme() -> None:
    hf = ModelSource.parse("hf://Qwen/Qwen2.5-7B-Instruct@v2")
    assert (hf.location, hf.revision, hf.downloaded) == ("Qwen/Qwen2.5-7B-Instruct", "v2", True)
    assert hf.cache_key() == "hf/Qwen/Qwen2.5-7B-Instruct/v2"
    pvc = ModelSource.parse("pvc://weights/llama/8b/")
    assert (pvc.location, pvc.path, pvc.downloaded) == ("weights", "llama/8b", False)
    s3 = ModelSource.parse("s3://bucket/models/llama/")
    assert (s3.bucket, s3.key_prefix) == ("bucket", "models/llama/")
    whole = ModelSource.parse("s3://bucket")
    assert (whole.bucket, whole.key_prefix) == ("bucket", "")


@pytest.mark.parametrize("text", ["gs://bucket/x", "hf://just-a-name", "pvc://Bad_Claim", ""])
def test_anything_else_is_refused_with_the_schemes(text: str) -> None:
    with pytest.raises(ValueError, match="is not hf://, pvc://, s3://, builtin:// or file://"):
        ModelSource.parse(text)
