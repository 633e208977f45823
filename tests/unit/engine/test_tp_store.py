"""The tensor-parallel rendezvous store listens on the loopback only: torch's default store
listens on every interface, where anyone who reaches the pod could join the ranks' group."""

from __future__ import annotations

import datetime
import os

import psutil
import torch.distributed as dist

from fleetllm.engine.executor import loopback_store


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(os.getpid()).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_store_listens_on_the_loopback_only_and_serves_the_ranks() -> None:
    before = _listening()
    listener, store = loopback_store()
    try:
        new = _listening() - before
        assert new == {("127.0.0.1", store.port)}
        rank = dist.TCPStore(
            "127.0.0.1", store.port, None, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        rank.set("rank0", "ready")
        assert store.get("rank0") == b"ready"
    finally:
        listener.close()
