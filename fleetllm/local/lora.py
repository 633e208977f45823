"""The local fleet's LoRA adapters. Every replica of a model gets each of the model's adapters
loaded through its load API once it answers /health and before the router sends it anything,
and again after each restart (a restarted engine holds none): so every adapter request the
router sends lands on a replica that holds the adapter.

An adapter a replica refuses (a corrupt file, a rank over lora.maxLoraRank) is reported with
the engine's reason, and the router answers its requests 404 with it; base traffic is not
affected. A load that did not happen for want of an answer is left to the router, which loads
an adapter no replica holds on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp

from fleetllm.lora_api import AdapterError, load_adapter
from fleetllm.router.lora import AdapterRoute

log = logging.getLogger("fleetllm.local")


async def load_adapters(
    session: aiohttp.ClientSession,
    model: str,
    replica: str,
    url: str,
    adapters: Mapping[str, str],
) -> dict[str, str]:
    """Load every adapter (name -> path) on the replica `replica` at `url`; name -> the
    engine's reason for each one it refused."""
    refused: dict[str, str] = {}
    for name, path in adapters.items():
        where = {"model": model, "adapter": name, "replica": replica, "url": url}
        try:
            await load_adapter(session, url, name, path)
        except AdapterError as exc:
            log.warning("adapter not loaded", extra={**where, "error": exc.message})
            if not exc.transient:
                refused[name] = exc.message
            continue
        log.info("adapter loaded", extra=where)
    return refused


def adapter_routes(
    adapters: Mapping[str, str], refused: Mapping[str, str]
) -> tuple[AdapterRoute, ...]:
    """What the router is told of a model's adapters: where each is, or why it failed."""
    return tuple(
        AdapterRoute(name, None, refused[name]) if name in refused else AdapterRoute(name, path)
        for name, path in adapters.items()
    )
