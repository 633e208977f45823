"""What `fleetllm up` runs for one LLMDeployment: its plan, and the command line of a replica
on this machine. Pure: the planned command with local addresses, no I/O.

A local replica runs the planned engine command with the planned arguments (planned for this
machine: the weights are where the local cache keeps them); only what a pod gets from
Kubernetes changes: the address (loopback, a free port; the router is the one way in), the
KV-event sockets of a model routed kv-aware (Unix sockets in a private folder, not the pod's
ports), the executable (this environment's, so the engine is the installed one) and, for CPU
replicas, a share of this machine's cores.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleetllm.api.deployment import LLMDeployment
from fleetllm.local.vllm import cpu_env
from fleetllm.planner.engine_argv import KV_EVENTS_FLAG, NUM_THREADS_FLAG, sets_flag
from fleetllm.planner.lora import lora_env
from fleetllm.planner.plan import Plan
from fleetllm.planner.timing import startup_seconds
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import KVEventsEndpoint

LOOPBACK = "127.0.0.1"
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class LocalModel:
    """One LLMDeployment as `fleetllm up` runs it."""

    cr: LLMDeployment
    plan: Plan
    where: str
    """The manifest it came from, for messages."""
    executable: tuple[str, ...]
    """What runs the planned command's program here (`fleetllm`, `vllm`)."""
    adapters: Mapping[str, str] = field(default_factory=dict)
    """Its LoRA adapters: name -> the folder the replicas load it from."""

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


def hold_timeout(models: Sequence[LocalModel]) -> float:
    """How long the router holds a request for a model without a ready replica: as long as
    the slowest replica may take to start (vLLM's CPU build compiles for minutes), so that a
    request that wakes a vLLM model at zero replicas is answered, not refused; the
    router's default for the builtin engine, which starts in seconds."""
    vllm = [m.startup_seconds for m in models if m.backend == "vllm"]
    return max([RouterSettings.hold_timeout, *vllm])


def kv_events_endpoint(model: LocalModel, sockets: Path, port: int) -> KVEventsEndpoint | None:
    """Where the replica listening on `port` publishes its KV events: Unix sockets in
    `sockets` (a folder only this user reaches); None unless its model is routed kv-aware."""
    if KV_EVENTS_FLAG not in model.plan.args:
        return None
    return KVEventsEndpoint(f"ipc://{sockets}/{port}-events", f"ipc://{sockets}/{port}-replay")


def local_args(model: LocalModel, port: int, events: KVEventsEndpoint | None = None) -> list[str]:
    """The planned arguments, listening on loopback:`port` instead of the pod's address, and
    publishing KV events at `events` instead of the pod's ports."""
    args = list(model.plan.args)
    for flag, value in (("--host", LOOPBACK), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if KV_EVENTS_FLAG in args:
        if events is None:
            raise ValueError(f"model {model.name} publishes KV events: give it their sockets")
        at = args.index(KV_EVENTS_FLAG) + 1
        config = {**json.loads(args[at]), "endpoint": events.events}
        config["replay_endpoint"] = events.replay
        args[at] = json.dumps(config, separators=(",", ":"))
    return args


def replica_argv(
    model: LocalModel,
    port: int,
    *,
    threads: int | None,
    events: KVEventsEndpoint | None = None,
) -> list[str]:
    """The full command line of one replica listening on loopback:`port`."""
    args = local_args(model, port, events)
    # The planned count is for a pod's CPU request; here the fleet shares this machine's cores
    # (`threads`). Extra args the user gave win over both.
    extra = model.cr.spec.engine.extra_args
    if model.backend == "builtin" and not sets_flag(extra, NUM_THREADS_FLAG):
        if NUM_THREADS_FLAG in args:
            at = args.index(NUM_THREADS_FLAG)
            del args[at : at + 2]
        if threads is not None:
            args += [NUM_THREADS_FLAG, str(threads)]
    return [*model.executable, *model.plan.command[1:], *args]


def spec_env(model: LocalModel, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with the spec's engine.env over it: what a pod's containers get from the spec,
    the weights' pull included (HF_TOKEN, HF_ENDPOINT, AWS_*)."""
    env = dict(base)
    for var in model.cr.spec.engine.env:
        env[var.name] = var.value or ""
    return env


def replica_env(
    model: LocalModel,
    base: Mapping[str, str],
    devices: Sequence[str] | None,
    cores: Sequence[int] = (),
) -> dict[str, str]:
    """The environment of one replica: ours, vLLM's settings (its threads on `cores`, the
    replica's slot of this machine's cores, for a CPU replica), the spec's variables, the GPUs
    it was given."""
    env = dict(base)
    if model.backend == "vllm":
        env.update(VLLM_ENV)
        if not model.plan.gpu.is_gpu and cores:
            env.update(cpu_env(cores))
    env.update(lora_env(model.cr.spec.lora))
    env = spec_env(model, env)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


class CorePool:
    """This machine's cores in equal slots, one per CPU replica the fleet may run at once.

    Each CPU replica computes on its own slot: the builtin engine runs as many threads as its
    slot has cores, and vLLM binds its OpenMP threads to them. Two OpenMP teams bound to the
    same cores wait for each other at every barrier, so a replica starting under load next
    to a busy one would crawl; disjoint slots keep replicas added under load off each other's
    cores. When more replicas run than there are slots (a draining one beside its
    replacement), the least used slot is shared."""

    def __init__(self, cores: Sequence[int], slots: int) -> None:
        cores = sorted(cores) or [0]
        width = max(1, len(cores) // max(1, slots))
        count = len(cores) // width
        self.slots = tuple(tuple(cores[i * width : (i + 1) * width]) for i in range(count))
        self._users = [0] * count

    def take(self) -> tuple[int, ...]:
        """The least used slot (the first of those)."""
        index = min(range(len(self.slots)), key=lambda i: (self._users[i], i))
        self._users[index] += 1
        return self.slots[index]

    def give_back(self, cores: tuple[int, ...]) -> None:
        self._users[self.slots.index(cores)] -= 1


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
