"""A tensor-parallel rank: one worker process holding one shard of the model and its KV cache.

The engine process (the driver) starts one worker per rank and drives them in lock-step over
a pipe each: every step it sends the same `StepInput` to all ranks, they run the forward pass
together (joined by torch.distributed collectives: gloo on the CPU, NCCL on GPUs), and rank 0
sends back the logits. Messages are pickled by hand (`send_bytes`), so tensors travel by value
and never through shared-memory handles.

A worker never outlives the engine: it ends on the driver's stop message, when its pipe closes
(the driver exited, even by SIGKILL), or when its parent process is gone (checked every
second, which also covers a worker blocked in a computation). It ignores SIGINT and SIGTERM,
which a terminal or a container runtime may send to the whole process group: the driver
decides when the ranks stop, after draining.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.loader import load_model
from fleetllm.engine.lora_layers import add_lora_layers
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.model_runner import ModelRunner
from fleetllm.engine.parallel import TensorParallel
from fleetllm.engine.quantization import quantize_model, weight_bytes
from fleetllm.engine.sizing import packs_linears

log = logging.getLogger(__name__)

# How long a collective may wait for the other ranks before failing the step; a dead peer is
# noticed at once (its connection closes), this bounds everything else.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
ORPHAN_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard; picklable."""

    model_dir: str
    dtype: torch.dtype
    device: str
    max_positions: int
    batch_hint: int
    block_size: int
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None
    adaptive_threads: bool = False  # the local executor's thread governor (cpu_threads.py)
    load_format: str = "auto"
    enforce_eager: bool = False
    max_loras: int = 0  # LoRA slots; 0: no LoRA
    max_lora_rank: int = 0


def load_shard(spec: WorkerSpec, tp: TensorParallel, device: torch.device) -> LlamaForCausalLM:
    """This rank's model shard, quantized if asked, its projections wrapped for LoRA if
    asked."""
    cfg = ModelConfig.from_pretrained(Path(spec.model_dir))
    model = load_model(
        Path(spec.model_dir),
        cfg,
        spec.dtype,
        device,
        spec.max_positions,
        spec.batch_hint,
        spec.load_format,
        tp=tp,
        pack=packs_linears(device.type, spec.quantization),
    )
    if spec.quantization is not None:
        quantize_model(model, spec.quantization)
    if spec.max_loras:
        add_lora_layers(model, spec.max_loras, spec.max_lora_rank, spec.dtype)
    return model


def lora_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the rank's LoRA slots (0 without LoRA)."""
    return model.lora.nbytes if model.lora is not None else 0


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    device = torch.device(spec.device)
    if device.type == "cuda":
        return torch.device("cuda", rank)
    return device


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory on a GPU; available RAM on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def worker_main(
    rank: int, size: int, store_port: int, conn: Connection, spec: WorkerSpec, parent_pid: int
) -> None:
    """Entry point of a rank's process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        _serve(rank, size, store_port, conn, spec)
    except (EOFError, BrokenPipeError):
        pass  # the driver is gone
    except BaseException as exc:
        with contextlib.suppress(OSError):
            send(conn, ("error", f"{type(exc).__name__}: {exc}"))
        # Skip interpreter teardown: other ranks' threads may still sit in a collective.
        os._exit(1)
    os._exit(0)


def _serve(rank: int, size: int, store_port: int, conn: Connection, spec: WorkerSpec) -> None:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = rank_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", store_port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    tp = TensorParallel(rank, size, dist.group.WORLD)
    model = load_shard(spec, tp, device)
    cfg = model.config
    send(
        conn,
        (
            "loaded",
            {
                "weight_bytes": weight_bytes(model),
                "lora_bytes": lora_bytes(model),
                "free_memory": free_memory_bytes(device),
            },
        ),
    )
    runner: ModelRunner | None = None
    while True:
        message = receive(conn)
        if message is None:
            break
        kind, payload = message
        if kind == "allocate":
            runner = ModelRunner(
                model,
                cfg,
                payload,
                spec.block_size,
                spec.dtype,
                device,
                spec.max_positions,
                spec.kv_cache_dtype,
                spec.batch_hint,
                spec.enforce_eager,
            )
            send(conn, ("allocated", (runner.kv_cache_bytes, runner.attention)))
        elif kind == "step":
            assert runner is not None, "step before allocate"
            logits = runner.execute(payload)
            if rank == 0:
                assert logits is not None
                send(conn, ("logits", logits.cpu().numpy()))
        else:
            raise ValueError(f"unknown message {kind!r}")
    dist.destroy_process_group()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_INTERVAL_S)
    os._exit(1)
