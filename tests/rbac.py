"""Kubernetes authorization in tests: what a request asks for, and what rendered RBAC allows.

`attributes` turns an HTTP request to the API server into the attributes RBAC checks (verb,
API group, resource/subresource, namespace, name) the way the API server's request-info
parser does; `grants` collects what a ServiceAccount is given by rendered Roles, ClusterRoles
and their bindings; `allows` is RBAC's rule match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str
    """With the subresource: `llmdeployments/scale`."""
    namespace: str | None
    """None for cluster-scoped objects and for lists and watches across all namespaces."""
    name: str | None


def attributes(
    method: str, path: str, params: Mapping[str, str], *, created: bool = False
) -> list[Attributes]:
    """What RBAC checks for one request: nothing for discovery (non-resource URLs such as
    /api and /apis/GROUP/VERSION, open to every authenticated user), else one set of
    attributes, and a second one (create) for a server-side apply that created its object."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = (parts[1] if len(parts) > 1 else ""), parts[3:]
    else:
        return []
    if not rest:
        return []
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    method = method.upper()
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            verb = "watch"
        else:
            verb = "get" if name is not None else "list"
    else:
        verb = {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name is not None else "deletecollection",
        }[method]
    found = [Attributes(verb, group, resource, namespace, name)]
    if created:
        found.append(Attributes("create", group, resource, namespace, name))
    return found


@dataclass(frozen=True)
class Grant:
    verb: str
    group: str
    resource: str
    namespace: str | None
    """None: everywhere (a ClusterRole bound by a ClusterRoleBinding)."""
    names: frozenset[str] | None
    role: str
    """Where the grant comes from, for messages: `ClusterRole NAME` or `Role NS/NAME`."""


def grants(objects: Iterable[Mapping[str, Any]], account: str, namespace: str) -> list[Grant]:
    """Every permission the ServiceAccount `namespace/account` has from these objects."""
    objects = list(objects)
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    found = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if subject not in binding.get("subjects", []):
            continue
        ref = binding["roleRef"]
        where = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role_namespace = where if ref["kind"] == "Role" else None
        role = roles[ref["kind"], role_namespace, ref["name"]]
        label = f"{ref['kind']} {(role_namespace + '/') if role_namespace else ''}{ref['name']}"
        for rule in role.get("rules", []):
            names = frozenset(rule["resourceNames"]) if rule.get("resourceNames") else None
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    for verb in rule.get("verbs", []):
                        found.append(Grant(verb, group, resource, where, names, label))
    return found


def allows(grant: Grant, request: Attributes) -> bool:
    if (grant.verb, grant.group, grant.resource) != (request.verb, request.group, request.resource):
        return False
    if grant.namespace is not None and request.namespace != grant.namespace:
        return False
    # resourceNames never allow lists, watches or creates (no name is known beforehand).
    return grant.names is None or (
        request.name in grant.names and request.verb not in ("list", "watch", "create")
    )


def wildcards(rules_of: Iterable[Mapping[str, Any]]) -> list[str]:
    """Rules of the given Roles/ClusterRoles that use `*` anywhere."""
    bad = []
    for role in rules_of:
        for rule in role.get("rules", []):
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                if any("*" in value for value in rule.get(field, [])):
                    bad.append(f"{role['kind']} {role['metadata']['name']}: {field} {rule}")
    return bad
