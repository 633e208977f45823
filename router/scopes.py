"""What one API key may reach: its scope over the fleet's models, and how a `model` a client
names resolves inside it. Pure functions over model ids and routes.

A key may name `models` (plain names or `NAMESPACE/NAME`, `*` globs) and `namespaces` (globs
too); a model is in scope when it matches both lists that are given, and a key with neither
reaches everything. A model's namespace is its LLMDeployment's (Kubernetes) or the `NS/` of a
static fleet id; a model with none (a static plain id) is outside any `namespaces` scope.

A model outside the scope is answered exactly as a model that does not exist, so that a key
cannot learn what others serve. A plain name reaches a model of that name only when exactly
one model in scope serves it: traffic never moves silently from one namespace to another when
a second one adds the same name, it is refused with the ids to use instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from fleetllm.router.discovery import ModelRoute


@dataclass(frozen=True)
class Scope:
    models: tuple[str, ...] | None = None
    namespaces: tuple[str, ...] | None = None

    @property
    def unrestricted(self) -> bool:
        return self.models is None and self.namespaces is None

    def allows(self, route: ModelRoute) -> bool:
        namespace = model_namespace(route)
        if self.namespaces is not None and (
            namespace is None or not any(fnmatchcase(namespace, p) for p in self.namespaces)
        ):
            return False
        if self.models is None:
            return True
        plain = plain_name(route)
        qualified = f"{namespace}/{plain}" if namespace is not None else plain
        return any(fnmatchcase(qualified if "/" in p else plain, p) for p in self.models)


EVERYTHING = Scope()


def model_namespace(route: ModelRoute) -> str | None:
    if route.owner is not None:
        return route.owner[0]
    namespace, slash, _ = route.name.partition("/")
    return namespace if slash else None


def plain_name(route: ModelRoute) -> str:
    """The model's name without its namespace: what a plain `model` names."""
    return route.served_name or route.name.rsplit("/", 1)[-1]


def resolve(
    requested: str, routes: Mapping[str, ModelRoute], aliases: Mapping[str, str], scope: Scope
) -> str | list[str] | None:
    """The id `requested` reaches within `scope`: by id, by alias (`NS/NAME` of a model whose
    id is plain), or as the plain name of exactly one model in scope. None when nothing in
    scope answers to it; the sorted candidate ids when a plain name is ambiguous."""
    for model_id in (requested, aliases.get(requested)):
        route = routes.get(model_id) if model_id is not None else None
        if route is not None and scope.allows(route):
            return route.name
    if "/" in requested:
        return None
    candidates = sorted(
        route.name
        for route in routes.values()
        if plain_name(route) == requested and scope.allows(route)
    )
    if len(candidates) == 1:
        return candidates[0]
    return candidates or None


def visible(routes: Iterable[ModelRoute], scope: Scope) -> list[str]:
    return sorted(route.name for route in routes if scope.allows(route))


def ambiguous_message(requested: str, candidates: list[str]) -> str:
    return (
        f"The model `{requested}` is served in several namespaces ({', '.join(candidates)}): "
        f"name one as NAMESPACE/{requested}."
    )


def missing_message(requested: str) -> str:
    """The one answer to a model that does not exist and to one outside the key's scope."""
    return f"The model `{requested}` does not exist."
