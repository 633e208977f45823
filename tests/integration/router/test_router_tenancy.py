"""Tenants kept apart by the router, over real engines: a key reaches only its scope (a model
outside it is answered exactly as one that does not exist, /v1/models lists only its own),
a plain name never moves between namespaces, and each tenant has its own prefix cache (the
router salts it per tenant; the engine reports `usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_testkit import EngineFleet, Process, engine_args, write_fleet

GUARD = 120.0

KEYS = """\
keys:
  - {name: a-one, key: sk-a-one-0123456789, namespaces: [team-a]}
  - {name: a-two, key: sk-a-two-0123456789, namespaces: [team-a]}
  - {name: b, key: sk-b-0123456789, namespaces: [team-b]}
  - {name: beta-only, key: sk-beta-0123456789, models: [beta]}
  - {name: ops, key: sk-ops-0123456789}
"""
# Long enough to fill several 16-token blocks of the engines' prefix cache.
PROMPT = "The quarterly numbers of the confidential plan are as follows, in order: " * 4


def _post(router: Process, key: str, model: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{router.url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=GUARD,
    )


def _models(router: Process, key: str) -> list[str]:
    r = httpx.get(
        f"{router.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=GUARD
    )
    return [m["id"] for m in r.json()["data"]]


def _headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k not in ("date", "x-request-id")}


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    if response.headers["Content-Type"].startswith("text/event-stream"):
        usage = [
            json.loads(e[6:])["usage"]
            for e in response.text.split("\n\n")
            if e.startswith("data: {") and '"usage"' in e
        ][-1]
    else:
        usage = response.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int)
    return cached


@pytest.fixture(scope="module")
def shared(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    """One engine that serves both teams' `chat` (a static fleet sends its ids as they are):
    every request of a test meets the same prefix cache."""
    args = engine_args(model_dirs["alpha"], "team-a/chat")
    at = args.index("team-a/chat") + 1
    engine = Process(
        [*args[:at], "team-b/chat", *args[at:]], tmp_path_factory.mktemp("shared") / "e.log"
    )
    try:
        engine.wait_healthy()
        yield engine
    finally:
        engine.close()


def _router(
    engines: EngineFleet,
    shared: Process,
    start_router: Any,
    tmp_path: Path,
    env: dict[str, str] | None = None,
) -> Process:
    fleet_file, keys_file = tmp_path / "fleet.json", tmp_path / "keys.yaml"
    write_fleet(
        fleet_file,
        {"team-a/chat": [shared.url], "team-b/chat": [shared.url], "beta": [engines.beta.url]},
    )
    keys_file.write_text(KEYS)
    args = ("--fleet-file", str(fleet_file), "--api-keys-file", str(keys_file))
    return start_router(*args, env=env)


def test_a_key_reaches_only_its_scope_and_learns_nothing_of_the_rest(
    engines: EngineFleet, shared: Process, start_router: Any, tmp_path: Path
) -> None:
    router = _router(engines, shared, start_router, tmp_path)
    assert _models(router, "sk-a-one-0123456789") == ["team-a/chat"]
    assert _models(router, "sk-beta-0123456789") == ["beta"]
    assert _models(router, "sk-ops-0123456789") == ["beta", "team-a/chat", "team-b/chat"]

    # Out of scope and nonexistent: the same answer byte for byte, the name swapped, with the
    # same headers (but the request's id and date), streamed or not, by id or by plain name.
    for body in ({}, {"stream": True}):
        for key, hidden_name, missing_name in (
            ("sk-a-one-0123456789", "team-b/chat", "team-z/chat"),
            ("sk-beta-0123456789", "team-a/chat", "team-q/chat"),
            ("sk-beta-0123456789", "chat", "nope"),
        ):
            hidden = _post(router, key, hidden_name, **body)
            missing = _post(router, key, missing_name, **body)
            assert hidden.status_code == missing.status_code == 404
            assert hidden.json()["error"]["code"] == 404
            assert hidden.content == missing.content.replace(
                f"`{missing_name}`".encode(), f"`{hidden_name}`".encode()
            )
            assert _headers(hidden) == _headers(missing) | {
                "content-length": str(len(hidden.content))
            }

    # A plain name resolves inside the key's namespaces...
    assert _post(router, "sk-a-one-0123456789", "chat").status_code == 200
    assert _post(router, "sk-b-0123456789", "chat").status_code == 200
    # ...and where two in scope serve it, it is refused with the ids to use, never guessed.
    ambiguous = _post(router, "sk-ops-0123456789", "chat")
    assert ambiguous.status_code == 404
    message = ambiguous.json()["error"]["message"]
    assert "team-a/chat, team-b/chat" in message and "NAMESPACE/chat" in message

    # The fleet-wide metrics are for keys that reach the whole fleet.
    for key, status in (("sk-a-one-0123456789", 403), ("sk-ops-0123456789", 200)):
        r = httpx.get(
            f"{router.url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=GUARD
        )
        assert r.status_code == status


def test_a_tenant_shares_its_prefix_cache_and_no_other_tenant_hits_it(
    engines: EngineFleet, shared: Process, start_router: Any, tmp_path: Path
) -> None:
    router = _router(engines, shared, start_router, tmp_path)
    # Both keys of team-a are one tenant: the second hits what the first cached.
    assert _cached(_post(router, "sk-a-one-0123456789", "team-a/chat")) == 0
    assert _cached(_post(router, "sk-a-two-0123456789", "team-a/chat")) > 0
    streamed = _post(router, "sk-a-one-0123456789", "team-a/chat", stream=True,
                     stream_options={"include_usage": True})  # fmt: skip
    assert _cached(streamed) > 0
    # Same replica, same prompt, other tenants (a namespace's key, a key of its own):
    # never a hit, streamed or not.
    assert _cached(_post(router, "sk-b-0123456789", "team-b/chat")) == 0
    streamed = _post(router, "sk-ops-0123456789", "team-a/chat", stream=True,
                     stream_options={"include_usage": True})  # fmt: skip
    assert _cached(streamed) == 0
    # A client's own cache_salt is respected (and so is a shared one, when it chooses one).
    assert _cached(_post(router, "sk-a-one-0123456789", "team-a/chat", cache_salt="s1")) == 0
    assert _cached(_post(router, "sk-b-0123456789", "team-b/chat", cache_salt="s1")) > 0


def test_router_replicas_of_one_fleet_give_a_tenant_one_cache(
    engines: EngineFleet, shared: Process, start_router: Any, tmp_path: Path
) -> None:
    # Two replicas of the fleet's router (the fleet's root in their env, as the chart gives
    # it) salt a tenant's requests alike; a router of another fleet (another root) does not.
    fleet = {"FLEETLLM_ENGINE_KEY_ROOT": "the-fleets-root-0123456789"}
    first, second = (_router(engines, shared, start_router, tmp_path, fleet) for _ in range(2))
    other = _router(engines, shared, start_router, tmp_path, {"FLEETLLM_ENGINE_KEY_ROOT": "x" * 24})
    prompt = {"prompt": "A prompt of its own, for this test alone, long enough to be cached: " * 4}
    assert _cached(_post(first, "sk-b-0123456789", "team-b/chat", **prompt)) == 0
    assert _cached(_post(second, "sk-b-0123456789", "team-b/chat", **prompt)) > 0
    assert _cached(_post(other, "sk-b-0123456789", "team-b/chat", **prompt)) == 0
