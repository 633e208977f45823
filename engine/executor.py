"""Where the model runs: in the engine's own process, or over tensor-parallel worker processes.

Both executors take a `StepInput` and return the step's float32 logits; the scheduler, block
manager and sampler above them are the same. `LocalExecutor` holds the whole model.
`MultiprocExecutor` starts one worker process per rank (see `worker.py`) and drives them in
lock-step; a rank that dies fails the engine at once, whether it died in a step (the step
raises) or while idle (a monitor thread notices its exit, stops the other ranks, and
`check_health` raises from then on).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from fleetllm.engine import cpu_threads
from fleetllm.engine.model_runner import ModelRunner, StepInput
from fleetllm.engine.parallel import TensorParallel
from fleetllm.engine.quantization import weight_bytes
from fleetllm.engine.worker import (
    COLLECTIVE_TIMEOUT,
    WorkerSpec,
    free_memory_bytes,
    load_shard,
    lora_bytes,
    receive,
    send,
    worker_main,
)

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


class LocalExecutor:
    """The whole model in this process (tensor_parallel_size=1)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.model = load_shard(spec, TensorParallel(), self.device)
        self.weight_bytes = [weight_bytes(self.model)]
        self.lora_bytes = [lora_bytes(self.model)]
        self.runner: ModelRunner | None = None
        # Steps run on the engine's thread, whose OpenMP thread count is its own: set there,
        # at the first step (`_govern_threads`).
        self.threads: cpu_threads.ThreadGovernor | None = None
        self._threads_set = self.device.type != "cpu"

    def free_memory_per_rank(self) -> int:
        return free_memory_bytes(self.device)

    def allocate_kv(self, num_blocks: int) -> list[int]:
        spec = self.spec
        self.runner = ModelRunner(
            self.model,
            self.model.config,
            num_blocks,
            spec.block_size,
            spec.dtype,
            self.device,
            spec.max_positions,
            spec.kv_cache_dtype,
            spec.batch_hint,
            spec.enforce_eager,
        )
        return [self.runner.kv_cache_bytes]

    @property
    def attention(self) -> dict[str, str]:
        return self.runner.attention if self.runner is not None else {}

    def execute(self, step: StepInput) -> torch.Tensor:
        assert self.runner is not None
        self._govern_threads()
        logits = self.runner.execute(step)
        assert logits is not None
        return logits

    def _govern_threads(self) -> None:
        if not self._threads_set:
            # Not given: the cores this thread may use (cpu_threads.rank_threads).
            threads = self.spec.num_threads or cpu_threads.usable_cores()
            torch.set_num_threads(threads)
            self._threads_set = True
            if self.spec.adaptive_threads:
                self.threads = cpu_threads.ThreadGovernor(threads)
        if self.threads is None:
            return
        threads = self.threads.observe(time.monotonic())
        if threads is not None:
            torch.set_num_threads(threads)
            extra = {"threads": threads, "max_threads": self.threads.max_threads}
            log.info("compute threads changed", extra=extra)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def loopback_store() -> dist.TCPStore:
    """A TCPStore that listens on the loopback only (the ranks are processes of this pod).
    Given a host and port, torch's store listens on every interface: anyone who reaches the
    pod could join or poison the rendezvous. The store closes the listening socket it is
    given, so it gets the descriptor itself (`detach`): a Python socket left holding the same
    number would close it a second time, after the number had gone to some other file."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=COLLECTIVE_TIMEOUT,
        master_listen_fd=listener.detach(),
    )


class MultiprocExecutor:
    """`size` worker processes, one per tensor-parallel rank, driven in lock-step."""

    def __init__(self, spec: WorkerSpec, size: int) -> None:
        self.spec = spec
        self.size = size
        self.attention: dict[str, str] = {}
        self.device = torch.device(spec.device)
        self._failure: str | None = None
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        # The ranks meet at a store this process hosts, on a free port of the loopback.
        self._store = loopback_store()
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, size, self._store.port, theirs, spec, os.getpid()),
                name=f"fleetllm-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        # Workers end with this object even if shutdown() is never called.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        try:
            loaded = self._replies(range(size))
        except BaseException:
            self.shutdown()
            raise
        self.weight_bytes = [info["weight_bytes"] for info in loaded]
        self.lora_bytes = [info["lora_bytes"] for info in loaded]
        self._free_memory = min(info["free_memory"] for info in loaded)
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        log.info(
            "tensor-parallel workers ready",
            extra={"ranks": size, "pids": [p.pid for p in self._procs]},
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def free_memory_per_rank(self) -> int:
        if self.device.type == "cuda":
            return self._free_memory  # each rank has its own device
        # On the CPU every rank shares this machine's memory, read now that all have loaded.
        return free_memory_bytes(self.device) // self.size

    def allocate_kv(self, num_blocks: int) -> list[int]:
        self._broadcast(("allocate", num_blocks))
        replies = self._replies(range(self.size))
        # Every rank runs the same kernels on its shard of the heads: rank 0's choice stands.
        self.attention = replies[0][1]
        return [kv_bytes for kv_bytes, _ in replies]

    def execute(self, step: StepInput) -> torch.Tensor:
        self.check_health()
        self._broadcast(("step", step))
        (logits,) = self._replies([0])
        return torch.from_numpy(logits)

    def check_health(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def shutdown(self) -> None:
        self._closing = True
        if hasattr(self, "_wake_w"):
            self._wake_w.send_bytes(b"")
        self._finalizer()

    # -- internals ----------------------------------------------------------------------------

    def _broadcast(self, message: object) -> None:
        try:
            for conn in self._conns:
                send(conn, message)
        except OSError as exc:
            self._fail(f"a tensor-parallel rank is gone ({exc})")
            raise WorkerFailedError(self._failure) from None

    def _replies(self, ranks: Any) -> list[Any]:
        """The payloads of the next message from each of `ranks`; raises if any rank reports
        an error or exits meanwhile."""
        pending = {self._conns[r]: r for r in ranks}
        results: dict[int, Any] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while pending:
            try:
                readable = wait([*self._conns, *sentinels])
            except (OSError, ValueError):  # the ranks were stopped meanwhile
                failure = self._failure or "the tensor-parallel ranks stopped"
                raise WorkerFailedError(failure) from None
            for ready in readable:
                if isinstance(ready, Connection):
                    rank = self._conns.index(ready)
                    try:
                        kind, payload = receive(ready)
                    except (EOFError, OSError):
                        continue  # its exit shows on the sentinel
                    if kind == "error":
                        self._fail(f"tensor-parallel rank {rank} failed: {payload}")
                        raise WorkerFailedError(self._failure)
                    if ready not in pending:
                        self._fail(f"tensor-parallel rank {rank} sent an unexpected {kind!r}")
                        raise WorkerFailedError(self._failure)
                    results[rank] = payload
                    del pending[ready]
                else:
                    rank = sentinels[ready]
                    self._fail(self._exit_message(rank))
                    raise WorkerFailedError(self._failure)
        return [results[r] for r in ranks]

    def _exit_message(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(0.1)
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def _fail(self, message: str) -> None:
        """Record the first failure and stop every rank: none can go on without the others."""
        if self._failure is None:
            self._failure = message
            log.error("tensor-parallel rank failed", extra={"error": message})
        self._closing = True
        self._finalizer()

    def _watch(self) -> None:
        """Between steps nothing talks to the ranks: notice one that exits on its own."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait([*sentinels, self._wake_r])
        if self._closing:
            return
        for obj in ready:
            if obj in sentinels:
                self._fail(self._exit_message(sentinels[obj]))
                return


def _stop(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask every rank to stop, then make sure: kill whatever has not exited in time."""
    for conn in conns:
        with contextlib.suppress(OSError):
            send(conn, None)
    for proc in procs:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
