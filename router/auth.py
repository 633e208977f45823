"""API keys and per-key rate limits.

Keys come from a file (reloaded on change) or a Kubernetes Secret (one key per data entry).
Only SHA-256 digests are kept, and a presented key is compared with every digest in constant
time, so neither a key nor which key matched leaks through timing. Limits are token buckets:
requests per minute, and tokens per minute charged after each response from its `usage`
(or an estimate where the response has none, or the client went away first); a key whose
token bucket is empty waits until it refills. A key may also cap its requests open at once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import yaml

from fleetllm.router.scopes import EVERYTHING, Scope


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    scope: Scope = EVERYTHING
    """The models the key may reach (see `scopes`)."""
    tenant: str | None = None
    """Whose prefix cache its requests share (see `tenant_of`)."""


def tenant_of(key: ApiKey) -> str:
    """The key's tenant: its `tenant`, else its namespaces, else its own name. Keys of one
    tenant share cached prompt prefixes; no other key's requests can hit them."""
    if key.tenant:
        return f"tenant:{key.tenant}"
    if key.scope.namespaces is not None:
        return "namespaces:" + ",".join(sorted(key.scope.namespaces))
    return f"key:{key.name}"


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _limit(value: Any, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def _names(value: Any, what: str, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{where}: {what} must be a list of non-empty strings")
    return tuple(v.strip() for v in value)


_KEY_FIELDS = {
    "name",
    "key",
    "requestsPerMinute",
    "tokensPerMinute",
    "maxConcurrentRequests",
    "models",
    "namespaces",
    "tenant",
}


def parse_keys(
    text: str,
    default_rpm: int | None = None,
    default_tpm: int | None = None,
    where: str = "keys file",
    default_concurrency: int | None = None,
) -> list[ApiKey]:
    """Either one key per line (`#` starts a comment), or YAML: `keys: [{name, key,
    requestsPerMinute, tokensPerMinute, maxConcurrentRequests, models, namespaces, tenant},
    ...]`; a key without `models` and `namespaces` reaches every model."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    keys: list[ApiKey] = []
    if isinstance(doc, dict):
        entries = doc.get("keys")
        if not isinstance(entries, list):
            raise ValueError(f"{where}: `keys` must be a list")
        for index, entry in enumerate(entries, start=1):
            at = f"{where}: keys[{index}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                raise ValueError(f"{at}: needs a string `key`")
            if not entry["key"].strip():
                raise ValueError(f"{at}: the key is empty")
            unknown = sorted(set(entry) - _KEY_FIELDS)
            if unknown:
                raise ValueError(f"{at}: unknown fields {unknown}")
            tenant = entry.get("tenant")
            if tenant is not None and (not isinstance(tenant, str) or not tenant.strip()):
                raise ValueError(f"{at}: tenant must be a non-empty string")
            scope = Scope(
                _names(entry.get("models"), "models", at),
                _names(entry.get("namespaces"), "namespaces", at),
            )
            rpm = _limit(entry.get("requestsPerMinute"), "requestsPerMinute", at)
            tpm = _limit(entry.get("tokensPerMinute"), "tokensPerMinute", at)
            cap = _limit(entry.get("maxConcurrentRequests"), "maxConcurrentRequests", at)
            keys.append(
                ApiKey(
                    name=str(entry.get("name") or f"key-{index}"),
                    digest=digest(entry["key"].strip()),
                    requests_per_minute=rpm if rpm is not None else default_rpm,
                    tokens_per_minute=tpm if tpm is not None else default_tpm,
                    max_concurrent=cap if cap is not None else default_concurrency,
                    scope=scope,
                    tenant=tenant.strip() if tenant else None,
                )
            )
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            secret = line.split("#", 1)[0].strip()
            if secret:
                name = f"key-{number}"
                keys.append(
                    ApiKey(name, digest(secret), default_rpm, default_tpm, default_concurrency)
                )
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: key names must be unique")
    return keys


def keys_from_secret(
    secret: dict[str, Any],
    default_rpm: int | None = None,
    default_tpm: int | None = None,
    default_concurrency: int | None = None,
) -> list[ApiKey]:
    """One key per data entry of a Kubernetes Secret, the entry's name naming the key; an
    entry named `*.yaml` or `*.yml` holds the YAML form instead (keys with limits and scopes)."""
    keys = []
    for name, encoded in sorted((secret.get("data") or {}).items()):
        try:
            value = base64.b64decode(encoded, validate=True).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError, TypeError):
            raise ValueError(f"Secret entry {name!r} is not base64 of UTF-8 text") from None
        if name.endswith((".yaml", ".yml")):
            where = f"Secret entry {name!r}"
            keys += parse_keys(value, default_rpm, default_tpm, where, default_concurrency)
        elif value:
            keys.append(ApiKey(name, digest(value), default_rpm, default_tpm, default_concurrency))
    if len({k.name for k in keys}) != len(keys):
        raise ValueError("Secret: key names must be unique")
    return keys


class KeyStore:
    """The keys in force. Disabled until a key source is configured; once it is, a request
    needs a key even when the source lists none."""

    def __init__(self) -> None:
        self.enabled = False
        self._keys: tuple[ApiKey, ...] = ()

    def replace(self, keys: list[ApiKey]) -> None:
        self.enabled = True
        self._keys = tuple(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, presented: str | None) -> ApiKey | None:
        if not presented:
            return None
        wanted = digest(presented)
        found = None
        for key in self._keys:
            # No early exit: the time taken does not depend on which key matched.
            if hmac.compare_digest(key.digest, wanted):
                found = key
        return found


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class _Bucket:
    __slots__ = ("capacity", "level", "updated")

    def __init__(self, capacity: float, now: float) -> None:
        self.capacity = capacity
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the level reaches `amount`."""
        return max(0.0, (amount - self.level) / (self.capacity / 60.0))


class RateLimiter:
    """Token buckets per key name (so that a reload with new limits keeps the spent budget)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    @staticmethod
    def _bucket(store: dict[str, _Bucket], name: str, capacity: int, now: float) -> _Bucket:
        bucket = store.get(name)
        if bucket is None:
            bucket = store[name] = _Bucket(capacity, now)
        elif bucket.capacity != capacity:
            bucket.capacity = capacity
            bucket.level = min(bucket.level, capacity)
        bucket.refill(now)
        return bucket

    def admit(self, key: ApiKey, now: float) -> float | None:
        """None when the request may go ahead (one request is taken from the budget), else
        the seconds until it could."""
        waits = []
        requests = tokens = None
        if key.requests_per_minute is not None:
            requests = self._bucket(self._requests, key.name, key.requests_per_minute, now)
            if requests.level < 1:
                waits.append(requests.wait_for(1))
        if key.tokens_per_minute is not None:
            tokens = self._bucket(self._tokens, key.name, key.tokens_per_minute, now)
            if tokens.level <= 0:
                waits.append(tokens.wait_for(1))
        if waits:
            return max(waits)
        if requests is not None:
            requests.level -= 1
        return None

    def charge_tokens(self, key: ApiKey, tokens: int, now: float) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        bucket = self._bucket(self._tokens, key.name, key.tokens_per_minute, now)
        bucket.level -= tokens
