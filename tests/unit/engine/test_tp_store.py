"""The tensor-parallel rendezvous store listens on the loopback only: torch's default store
listens on every interface, where anyone who reaches the pod could join the ranks' group."""

from __future__ import annotations

import datetime
import gc
import os
from pathlib import Path

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
    store = loopback_store()
    new = _listening() - before
    assert new == {("127.0.0.1", store.port)}
    rank = dist.TCPStore(
        "127.0.0.1", store.port, None, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    rank.set("rank0", "ready")
    assert store.get("rank0") == b"ready"
    del rank, store
    gc.collect()
    assert _listening() == before


def test_the_listening_socket_is_closed_once_by_its_one_owner(tmp_path: Path) -> None:
    """The store closes the descriptor it listens on. Had anything else kept it too, that
    owner would close the same number again later, by then another file's: an open file
    elsewhere in the process would fail with EBADF."""
    fds_before = psutil.Process().num_fds()
    store = loopback_store()
    del store
    gc.collect()
    assert psutil.Process().num_fds() == fds_before
    with (tmp_path / "reused").open("w") as reused:  # likely the number the socket had
        gc.collect()
        reused.write("still open")
        reused.flush()
        os.fstat(reused.fileno())
