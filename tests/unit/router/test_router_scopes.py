"""Key scopes: which models a key reaches, how plain names resolve inside its scope, and the
keys file and Secret forms that carry them."""

from __future__ import annotations

import base64

import pytest

from fleetllm.router.auth import keys_from_secret, parse_keys, tenant_of
from fleetllm.router.discovery import ModelRoute, parse_static_fleet
from fleetllm.router.scopes import EVERYTHING, Scope, resolve, visible

# Kubernetes ids (all namespaces) and a static fleet's ids side by side.
ROUTES = {
    "team-a/llama": ModelRoute("team-a/llama", owner=("team-a", "chat"), served_name="llama"),
    "team-b/llama": ModelRoute("team-b/llama", owner=("team-b", "chat"), served_name="llama"),
    "team-b/coder": ModelRoute("team-b/coder", owner=("team-b", "code"), served_name="coder"),
    **parse_static_fleet({"models": {"ops/embed": [], "plain": []}}),
}


def _resolve(name: str, scope: Scope) -> str | list[str] | None:
    return resolve(name, ROUTES, {}, scope)


def test_a_key_without_scope_reaches_everything_but_never_guesses_a_namespace() -> None:
    assert visible(ROUTES.values(), EVERYTHING) == sorted(ROUTES)
    assert _resolve("team-a/llama", EVERYTHING) == "team-a/llama"
    assert _resolve("coder", EVERYTHING) == "team-b/coder"
    assert _resolve("embed", EVERYTHING) == "ops/embed"
    assert _resolve("plain", EVERYTHING) == "plain"
    # Two namespaces serve it: refused with the ids to use, never routed to either.
    assert _resolve("llama", EVERYTHING) == ["team-a/llama", "team-b/llama"]
    assert _resolve("nope", EVERYTHING) is None


def test_namespaces_scope_resolves_plain_names_inside_them_only() -> None:
    scope = Scope(namespaces=("team-b",))
    assert visible(ROUTES.values(), scope) == ["team-b/coder", "team-b/llama"]
    assert _resolve("llama", scope) == "team-b/llama"
    assert _resolve("team-a/llama", scope) is None
    # A model without a namespace (a static plain id) is outside any namespaces scope.
    assert _resolve("plain", scope) is None
    assert visible(ROUTES.values(), Scope(namespaces=("team-*",))) == [
        "team-a/llama",
        "team-b/coder",
        "team-b/llama",
    ]


def test_models_scope_matches_plain_and_qualified_globs() -> None:
    assert visible(ROUTES.values(), Scope(models=("llama",))) == ["team-a/llama", "team-b/llama"]
    assert visible(ROUTES.values(), Scope(models=("team-a/*", "plain"))) == [
        "plain",
        "team-a/llama",
    ]
    assert visible(ROUTES.values(), Scope(models=("ops/emb*",))) == ["ops/embed"]
    both = Scope(models=("llama",), namespaces=("team-a",))
    assert visible(ROUTES.values(), both) == ["team-a/llama"]
    assert _resolve("llama", both) == "team-a/llama"
    assert _resolve("coder", both) is None


def test_single_namespace_aliases_stay_inside_the_scope() -> None:
    routes = {"llama": ModelRoute("llama", owner=("ml", "chat"), aliases=("ml/llama",))}
    aliases = {"ml/llama": "llama"}
    assert resolve("ml/llama", routes, aliases, EVERYTHING) == "llama"
    assert resolve("ml/llama", routes, aliases, Scope(namespaces=("other",))) is None
    assert resolve("llama", routes, aliases, Scope(models=("ml/llama",))) == "llama"


def test_keys_file_scopes_and_tenants() -> None:
    keys = parse_keys(
        "keys:\n"
        "  - {name: a1, key: k1, namespaces: [team-a], models: ['llama*']}\n"
        "  - {name: a2, key: k2, namespaces: [team-a, team-c]}\n"
        "  - {name: t, key: k3, tenant: acme, models: [team-b/coder]}\n"
        "  - {name: all, key: k4}\n"
    )
    by_name = {k.name: k for k in keys}
    assert by_name["a1"].scope == Scope(("llama*",), ("team-a",))
    assert by_name["all"].scope.unrestricted
    # Keys of one namespace set are one tenant, whatever their model lists.
    assert tenant_of(by_name["a1"]) == "namespaces:team-a"
    assert tenant_of(by_name["a2"]) == "namespaces:team-a,team-c"
    assert tenant_of(by_name["t"]) == "tenant:acme"
    assert tenant_of(by_name["all"]) == "key:all"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{key: k, models: llama}", "models must be a list of non-empty strings"),
        ("{key: k, namespaces: ['']}", "namespaces must be a list of non-empty strings"),
        ("{key: k, tenant: ''}", "tenant must be a non-empty string"),
        ("{key: k, model: [x]}", "unknown fields ['model']"),
    ],
)
def test_keys_file_refuses_bad_scope_fields(entry: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_keys(f"keys:\n  - {entry}\n")


def test_secret_entries_named_yaml_carry_the_yaml_form() -> None:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    secret = {
        "data": {
            "plain-key": b64("sk-plain"),
            "keys.yaml": b64("keys:\n  - {name: team-a, key: sk-a, namespaces: [team-a]}\n"),
        }
    }
    keys = {k.name: k for k in keys_from_secret(secret)}
    assert keys["plain-key"].scope.unrestricted
    assert keys["team-a"].scope == Scope(namespaces=("team-a",))
    duplicate = {"data": {"team-a": b64("x"), "keys.yaml": secret["data"]["keys.yaml"]}}
    with pytest.raises(ValueError, match="unique"):
        keys_from_secret(duplicate)
