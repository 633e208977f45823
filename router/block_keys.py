"""A request's block keys as each kind of replica computes them, so the router can look them up
in what the replicas report holding (`kv_index`).

Two schemes, told apart by the keys a replica's events carry:
- fleetllm's engine: 32-byte chained SHA-256 keys from `fleetllm.block_hash`, the engine's
  own function (the cache salt is in the chain's root).
- vLLM (its default `--prefix-caching-hash-algo sha256`): SHA-256 of the pickled tuple
  (parent key, block's token ids, extra keys), from a root derived from a seed
  ("vllm-none-hash", or PYTHONHASHSEED where set); the cache salt is an extra key of the
  first block. Its events carry each key's low 64 bits as an integer (vLLM's default,
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
A replica whose first-block keys do not match its scheme (another hash algorithm, another
seed) is caught by `first_block_matches` and not trusted.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from fleetllm.block_hash import chain_hashes, root_hash
from fleetllm.kv_events import BlockKey

VLLM_DEFAULT_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1


class Scheme(enum.Enum):
    FLEETLLM = "fleetllm"
    VLLM = "vllm"


def scheme_of(key: BlockKey) -> Scheme | None:
    """The scheme whose keys look like `key`; None for neither."""
    if isinstance(key, int):
        return Scheme.VLLM
    return Scheme.FLEETLLM if len(key) == 32 else None


def _vllm_digest(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class VllmHasher:
    """vLLM's sha256 block hashing, reproduced with the standard library."""

    def __init__(self, seed: str = VLLM_DEFAULT_SEED) -> None:
        self.none_hash = _vllm_digest(seed)

    def chain(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None, limit: int
    ) -> list[int]:
        count = min(len(token_ids) // block_size, limit)
        parent = self.none_hash
        out: list[int] = []
        salt = (("cache_salt", cache_salt),) if cache_salt else None
        for i in range(count):
            block = tuple(token_ids[i * block_size : (i + 1) * block_size])
            parent = _vllm_digest((parent, block, salt if i == 0 else None))
            out.append(int.from_bytes(parent, "big") & _LOW_64)
        return out


def request_keys(
    scheme: Scheme,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    limit: int,
    vllm: VllmHasher,
) -> list[BlockKey]:
    """The keys of the first `limit` full blocks of a request under `scheme`."""
    if scheme is Scheme.FLEETLLM:
        return list(chain_hashes(root_hash(cache_salt), token_ids, block_size, limit))
    return list(vllm.chain(token_ids, block_size, cache_salt, limit))


def first_block_matches(
    key: BlockKey, token_ids: Sequence[int], block_size: int, vllm: VllmHasher
) -> bool:
    """Whether `key` is what its scheme gives the unsalted first block `token_ids`."""
    scheme = scheme_of(key)
    if scheme is None or len(token_ids) < block_size:
        return False
    return request_keys(scheme, token_ids, block_size, None, 1, vllm) == [key]
