"""API keys (file and Secret formats, lookup) and per-key rate limits."""

from __future__ import annotations

import base64

import pytest

from fleetllm.router.auth import (
    ApiKey,
    KeyStore,
    RateLimiter,
    bearer_token,
    digest,
    keys_from_secret,
    parse_keys,
)


def test_plain_file_one_key_per_line_with_comments() -> None:
    keys = parse_keys("# team keys\nsk-one\n\n  sk-two   # the second\n", default_rpm=5)
    assert [k.name for k in keys] == ["key-2", "key-4"]
    assert keys[0].digest == digest("sk-one") and keys[1].digest == digest("sk-two")
    assert all(k.requests_per_minute == 5 and k.tokens_per_minute is None for k in keys)


def test_yaml_file_with_per_key_limits_and_defaults() -> None:
    text = (
        "keys:\n"
        "  - {name: alice, key: sk-a, requestsPerMinute: 10}\n"
        "  - {name: bob, key: sk-b, tokensPerMinute: 1000}\n"
    )
    alice, bob = parse_keys(text, default_rpm=60, default_tpm=5000)
    assert (alice.name, alice.requests_per_minute, alice.tokens_per_minute) == ("alice", 10, 5000)
    assert (bob.name, bob.requests_per_minute, bob.tokens_per_minute) == ("bob", 60, 1000)


def test_concurrency_caps_per_key_and_by_default() -> None:
    text = "keys:\n  - {name: a, key: sk-a, maxConcurrentRequests: 3}\n  - {name: b, key: sk-b}\n"
    a, b = parse_keys(text, default_concurrency=8)
    assert (a.max_concurrent, b.max_concurrent) == (3, 8)
    assert parse_keys("sk-x\n", default_concurrency=2)[0].max_concurrent == 2
    assert parse_keys("sk-x\n")[0].max_concurrent is None
    secret = {"data": {"t": base64.b64encode(b"sk-t").decode()}}
    assert keys_from_secret(secret, default_concurrency=4)[0].max_concurrent == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: nope", "must be a list"),
        ("keys:\n  - {name: a}", "needs a string `key`"),
        ("keys:\n  - {key: '  '}", "empty"),
        ("keys:\n  - {key: a, requestsPerMinute: 0}", "positive integer"),
        ("keys:\n  - {key: a, tokensPerMinute: many}", "positive integer"),
        ("keys:\n  - {key: a, maxConcurrentRequests: 0}", "maxConcurrentRequests must be"),
        ("keys:\n  - {key: a, maxConcurrentRequests: true}", "maxConcurrentRequests must be"),
        ("keys:\n  - {name: x, key: a}\n  - {name: x, key: b}", "unique"),
    ],
)
def test_bad_key_files_are_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_keys(text)


def test_secret_entries_are_keys() -> None:
    secret = {
        "data": {
            "team-a": base64.b64encode(b"sk-a\n").decode(),
            "team-b": base64.b64encode(b"sk-b").decode(),
        }
    }
    keys = keys_from_secret(secret, default_tpm=100)
    assert [(k.name, k.digest, k.tokens_per_minute) for k in keys] == [
        ("team-a", digest("sk-a"), 100),
        ("team-b", digest("sk-b"), 100),
    ]
    with pytest.raises(ValueError, match="base64"):
        keys_from_secret({"data": {"x": "%%%"}})


def test_key_store_matches_only_listed_keys() -> None:
    store = KeyStore()
    assert not store.enabled
    store.replace(parse_keys("sk-one\nsk-two\n"))
    assert store.enabled and len(store) == 2
    found = store.authenticate("sk-two")
    assert found is not None and found.name == "key-2"
    assert store.authenticate("sk-three") is None
    assert store.authenticate("") is None
    assert store.authenticate(None) is None
    store.replace([])
    assert store.enabled and store.authenticate("sk-one") is None


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token("bearer   sk-1 ") == "sk-1"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_requests_per_minute_bucket_refills_over_time() -> None:
    limiter = RateLimiter()
    key = ApiKey("k", digest("x"), requests_per_minute=3)
    assert [limiter.admit(key, 0.0) for _ in range(3)] == [None, None, None]
    wait = limiter.admit(key, 0.0)
    assert wait == pytest.approx(20.0)  # one request refills every 60/3 s
    assert limiter.admit(key, 10.0) == pytest.approx(10.0)
    assert limiter.admit(key, 20.0) is None
    assert limiter.admit(key, 20.0) is not None


def test_tokens_per_minute_are_charged_after_the_fact() -> None:
    limiter = RateLimiter()
    key = ApiKey("k", digest("x"), tokens_per_minute=600)
    assert limiter.admit(key, 0.0) is None
    limiter.charge_tokens(key, 700, 0.0)  # the answer used more than the whole budget
    wait = limiter.admit(key, 0.0)
    assert wait == pytest.approx(101 / 10)  # back above zero at 10 tokens per second
    assert limiter.admit(key, 11.0) is None


def test_keys_without_limits_are_never_limited_and_other_keys_are_separate() -> None:
    limiter = RateLimiter()
    free = ApiKey("free", digest("f"))
    tight = ApiKey("tight", digest("t"), requests_per_minute=1)
    assert all(limiter.admit(free, 0.0) is None for _ in range(100))
    assert limiter.admit(tight, 0.0) is None
    assert limiter.admit(tight, 0.0) is not None
    other = ApiKey("other", digest("o"), requests_per_minute=1)
    assert limiter.admit(other, 0.0) is None


def test_a_reload_with_a_new_limit_keeps_the_spent_budget() -> None:
    limiter = RateLimiter()
    assert limiter.admit(ApiKey("k", digest("x"), requests_per_minute=2), 0.0) is None
    assert limiter.admit(ApiKey("k", digest("x"), requests_per_minute=2), 0.0) is None
    # Raising the limit does not hand out a fresh full bucket.
    assert limiter.admit(ApiKey("k", digest("x"), requests_per_minute=10), 0.0) is not None
