"""The engine key derivation shared by the operator (which writes it into each LLMDeployment's
key Secret) and the router (which sends it): stable, distinct per namespace, name and uid, and
per root; never from an empty root."""

from __future__ import annotations

import pytest

from fleetllm.api.contract import engine_key

ROOT = "r" * 48


def test_the_key_is_stable_and_shared_by_str_and_bytes_roots() -> None:
    key = engine_key(ROOT, "team-a", "llama", "uid-1")
    assert key == engine_key(ROOT, "team-a", "llama", "uid-1")
    assert key == engine_key(ROOT.encode(), "team-a", "llama", "uid-1")
    # 256 bits, urlsafe base64 without padding: fits a header and an env var as it is.
    assert len(key) == 43 and key.replace("-", "").replace("_", "").isalnum()


def test_each_namespace_name_uid_and_root_has_its_own_key() -> None:
    keys = {
        engine_key(ROOT, "team-a", "llama", "uid-1"),
        engine_key(ROOT, "team-b", "llama", "uid-1"),
        engine_key(ROOT, "team-a", "llama2", "uid-1"),
        engine_key(ROOT, "team-a", "llama", "uid-2"),
        engine_key("another root", "team-a", "llama", "uid-1"),
    }
    assert len(keys) == 5
    assert ROOT not in "".join(keys)


def test_an_empty_root_is_refused() -> None:
    with pytest.raises(ValueError, match="root is empty"):
        engine_key("", "team-a", "llama", "uid-1")
