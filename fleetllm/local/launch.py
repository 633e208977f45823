"""What `fleetllm up` runs for one LLMDeployment: its plan, and the command line of a replica
on this machine. Pure: the planned command with local addresses, no I/O.

A local replica runs the planned engine command with the planned arguments; only what a pod
gets from Kubernetes changes: the address (loopback, a free port; the router is the one way
in), the interpreter (this one, so the engine is the installed fleetllm), the drain time (a
pod's termination grace period) and, for CPU replicas, a share of this machine's cores.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleetllm.operator.api import LLMDeployment
from fleetllm.operator.planner import Plan
from fleetllm.operator.render import startup_seconds

LOOPBACK = "127.0.0.1"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class LocalModel:
    """One LLMDeployment as `fleetllm up` runs it."""

    cr: LLMDeployment
    plan: Plan
    where: str
    """The manifest it came from, for messages."""

    @property
    def name(self) -> str:
        """The served model name (the `model` of requests)."""
        return self.cr.spec.model.name

    @property
    def backend(self) -> str:
        return self.cr.spec.engine.backend

    @property
    def min_replicas(self) -> int:
        scaling = self.cr.spec.scaling
        return self.cr.spec.desired_replicas() if scaling is None else scaling.min_replicas

    @property
    def max_replicas(self) -> int:
        scaling = self.cr.spec.scaling
        if scaling is None:
            # Without scaling, a model at zero replicas still gets one on demand.
            return max(1, self.cr.spec.desired_replicas())
        return scaling.max_replicas

    @property
    def initial_replicas(self) -> int:
        return self.cr.spec.desired_replicas()

    @property
    def devices_per_replica(self) -> int:
        return self.plan.devices if self.plan.gpu.is_gpu else 0

    @property
    def startup_seconds(self) -> int:
        """How long a replica may take to answer /health with 200 before it is restarted."""
        return startup_seconds(self.plan)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def model_reference(model: LocalModel) -> str:
    """The planned `--model` value: what the engine loads."""
    args = list(model.plan.args)
    return args[args.index("--model") + 1]


def local_args(args: Sequence[str], port: int) -> list[str]:
    """The planned arguments with the replica's own address: loopback, `port`."""
    out = list(args)
    for flag, value in (("--host", LOOPBACK), ("--port", str(port))):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def engine_command(plan: Plan) -> list[str]:
    """The planned command, run by this Python (the planned `fleetllm` and `python3` are the
    container's)."""
    if plan.command[0] == "fleetllm":
        return [sys.executable, "-m", "fleetllm.cli", *plan.command[1:]]
    if plan.command[-1] == VLLM_MODULE:
        return [sys.executable, "-m", VLLM_MODULE]
    return list(plan.command)


def cpu_threads(cpu_count: int, cpu_replicas: int) -> int:
    """Torch threads per CPU replica: the cores shared out over the most CPU replicas the
    fleet may run, so that replicas added under load do not fight over the same cores."""
    return max(1, cpu_count // max(1, cpu_replicas))


def replica_argv(
    model: LocalModel, port: int, *, threads: int | None, drain_seconds: float
) -> list[str]:
    """The full command line of one replica listening on loopback:`port`."""
    args = local_args(model.plan.args, port)
    if model.backend == "builtin":
        # Extra args the user gave win over these local defaults.
        if not _has_flag(args, "--shutdown-grace-period"):
            args += ["--shutdown-grace-period", f"{drain_seconds:g}"]
        if threads is not None and not _has_flag(args, "--num-threads"):
            args += ["--num-threads", str(threads)]
        if model.plan.gpu.is_gpu and not _has_flag(args, "--device"):
            args += ["--device", "cuda"]
    return [*engine_command(model.plan), *args]


def replica_env(
    model: LocalModel, base: Mapping[str, str], devices: Sequence[str] | None
) -> dict[str, str]:
    """The environment of one replica: ours, the spec's variables, the GPUs it was given."""
    env = dict(base)
    if model.backend == "vllm":
        env.update(VLLM_ENV)
    for var in model.cr.spec.engine.env:
        env[var.name] = var.value or ""
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


class GPUPool:
    """This machine's GPUs, handed out whole to replicas (CUDA_VISIBLE_DEVICES)."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self._free = list(devices)

    def take(self, count: int) -> tuple[str, ...] | None:
        """`count` free devices, or None when fewer are free."""
        if count > len(self._free):
            return None
        taken, self._free = tuple(self._free[:count]), self._free[count:]
        return taken

    def give_back(self, devices: Sequence[str]) -> None:
        self._free = [d for d in self.devices if d in self._free or d in devices]
