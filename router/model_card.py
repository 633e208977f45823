"""What the router learns from a replica's own model card (`GET /v1/models`, vLLM's and the
builtin engine's): the context length it serves, which the router's /v1/models reports. The
replica is the one owner of that fact (its `--max-model-len`), whichever discovery found it.

`max_model_len_of` is pure; `fetch_max_model_len` reads the card, bounded in size and time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from fleetllm.httpread import TooLarge, read_bounded

CARD_MAX_BYTES = 1 << 20
"""A card lists the model and its adapters: kilobytes; more is a replica to distrust."""
MAX_CONTEXT = 1 << 40
"""Larger than any model's context; a larger number from a replica is not believed."""


def max_model_len_of(doc: Any, served: str) -> int | None:
    """The `max_model_len` of the card whose `id` is `served` in a /v1/models answer; None
    where there is none, or it is not a positive integer within reason."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    for card in data:
        if isinstance(card, dict) and card.get("id") == served:
            value = card.get("max_model_len")
            valid = isinstance(value, int) and not isinstance(value, bool)
            return value if valid and 0 < value <= MAX_CONTEXT else None
    return None


async def fetch_max_model_len(
    session: aiohttp.ClientSession,
    url: str,
    served: str,
    headers: Mapping[str, str],
    timeout: float,
) -> int | None:
    """The replica's context length for `served`; None when its card cannot be read."""
    try:
        async with session.get(
            url + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            if r.status != 200:
                return None
            body = await read_bounded(r, CARD_MAX_BYTES)
    except (aiohttp.ClientError, TimeoutError, TooLarge):
        return None
    try:
        return max_model_len_of(json.loads(body), served)
    except (ValueError, RecursionError):
        return None
