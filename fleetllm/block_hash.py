"""The prefix-cache key of a KV block: what the engine caches blocks under and what the router
computes, from a request's tokens, to know which replica holds them. One owner for both, so
the two can never drift apart.

A full block is keyed by a chained SHA-256 of (the parent block's key, its token ids), so equal
keys mean equal whole prefixes. The chain starts at a root that holds everything besides the
tokens that decides whether two requests may share a block: the request's `cache_salt` and its
LoRA adapter (requests with different salts or adapters never share a block); any further
request-level key joins the chain there, in `root_hash`, and nowhere else. A cryptographic
hash matters: blocks are looked up by key alone, so two prefixes whose keys collide would
share KV entries, and a client able to craft such collisions (easy with Python's `hash`)
could poison other tenants' outputs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # a SHA-256 digest

_UNSALTED_ROOT: BlockHash = hashlib.sha256(b"fleetllm-prefix-cache\0").digest()


def root_hash(cache_salt: str | None = None, lora_key: bytes | None = None) -> BlockHash:
    """The parent of a request's first block: one per salt and LoRA adapter (its 32-byte
    key), and one for neither. KV computed with an adapter differs from the base model's and
    from every other adapter's, so blocks are never shared across adapters."""
    if lora_key is None:
        if cache_salt is None:
            return _UNSALTED_ROOT
        return hashlib.sha256(b"fleetllm-prefix-cache-salt\0" + cache_salt.encode()).digest()
    salt = b"\0" if cache_salt is None else b"\1" + cache_salt.encode()
    return hashlib.sha256(b"fleetllm-prefix-cache-lora\0" + lora_key + salt).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 over a canonical encoding: the parent's 32 bytes, then each token id as a
    little-endian signed 64-bit integer. Every input has one encoding and a block's length is
    fixed, so distinct (parent, tokens) pairs only share a key through a SHA-256 collision."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def chain_hashes(
    root: BlockHash, token_ids: Sequence[int], block_size: int, limit: int | None = None
) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids` under `root`, first block first (at most
    `limit` of them)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    out: list[BlockHash] = []
    parent = root
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
