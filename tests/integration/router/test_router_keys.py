"""Acceptance 5: API keys and per-key rate limits on the router, over a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from router_testkit import EngineFleet, wait_until, write_fleet

GUARD = 120.0

KEYS = """\
keys:
  - {name: team-open, key: sk-open-0123456789}
  - {name: team-tight, key: sk-tight-0123456789, requestsPerMinute: 2}
  - {name: team-tokens, key: sk-tokens-0123456789, tokensPerMinute: 20}
"""


def _post(url: str, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    payload = {"model": "beta", "prompt": "The secret plan is", "max_tokens": 4, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=GUARD)


def test_keys_and_rate_limits(engines: EngineFleet, start_router: Any, tmp_path: Path) -> None:
    fleet_file, keys_file = tmp_path / "fleet.json", tmp_path / "keys.yaml"
    write_fleet(fleet_file, {"beta": [engines.beta.url]})
    keys_file.write_text(KEYS)
    router = start_router("--fleet-file", str(fleet_file), "--api-keys-file", str(keys_file))

    for key in (None, "sk-wrong", "sk-open-012345678", "Bearer"):
        r = _post(router.url, key)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "beta", "prompt": "x"},
        headers={"Authorization": "Basic sk-open-0123456789"},
        timeout=GUARD,
    )
    assert r.status_code == 401
    assert httpx.get(f"{router.url}/v1/models", timeout=GUARD).status_code == 401
    # Health stays open to probes; what names the fleet needs a key.
    assert httpx.get(f"{router.url}/health", timeout=GUARD).status_code == 200
    for path in ("/metrics", "/version", "/openapi.json"):
        assert httpx.get(f"{router.url}{path}", timeout=GUARD).status_code == 401
        keyed = httpx.get(
            f"{router.url}{path}",
            headers={"Authorization": "Bearer sk-open-0123456789"},
            timeout=GUARD,
        )
        assert keyed.status_code == 200

    for _ in range(5):
        assert _post(router.url, "sk-open-0123456789").status_code == 200
    models = httpx.get(
        f"{router.url}/v1/models",
        headers={"Authorization": "Bearer sk-open-0123456789"},
        timeout=GUARD,
    )
    assert [m["id"] for m in models.json()["data"]] == ["beta"]

    assert _post(router.url, "sk-tight-0123456789").status_code == 200
    assert _post(router.url, "sk-tight-0123456789").status_code == 200
    limited = _post(router.url, "sk-tight-0123456789")
    assert limited.status_code == 429
    assert limited.json()["error"]["type"] == "RateLimitError"
    assert 1 <= int(limited.headers["Retry-After"]) <= 30
    # Another key's budget is its own.
    assert _post(router.url, "sk-open-0123456789").status_code == 200

    # Token budget: the first answer's usage (prompt + 30 completion tokens) overdraws 20/min.
    assert _post(router.url, "sk-tokens-0123456789", max_tokens=30).status_code == 200
    assert _post(router.url, "sk-tokens-0123456789", max_tokens=1).status_code == 429

    # The file is read again when it changes.
    keys_file.write_text("keys:\n  - {name: rotated, key: sk-rotated-0123456789}\n")
    wait_until(
        lambda: _post(router.url, "sk-rotated-0123456789").status_code == 200,
        "the new key is accepted",
        GUARD,
    )
    assert _post(router.url, "sk-open-0123456789").status_code == 401

    log = router.log_text()
    assert "sk-open" not in log and "sk-rotated" not in log and "secret plan" not in log
    assert '"key": "team-open"' in log  # request lines name the key, never show it
