"""A local replica runs the planned command with the planned arguments; only the address,
the interpreter and the CPU cores it computes on are its own."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from fleetllm.local.deployments import load_fleet
from fleetllm.local.launch import (
    CorePool,
    GPUPool,
    LocalModel,
    replica_argv,
    replica_env,
)
from fleetllm.local.vllm import vllm_executable

VLLM_TP2 = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {name: qwen}
spec:
  model: {name: qwen-7b, source: hf://Qwen/Qwen2.5-7B-Instruct}
  engine:
    backend: vllm
    env: [{name: VLLM_LOGGING_LEVEL, value: DEBUG}]
  parallelism: {tensor: 2}
  gpu: {type: L4}
  maxModelLen: 8192
  scaling: {minReplicas: 1, maxReplicas: 3}
"""


VLLM = Path("/opt/vllm/bin/python")


def _model(tmp_path: Path, text: str) -> LocalModel:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    (model,) = load_fleet([path], vllm=VLLM, cache=tmp_path / "cache")
    return model


def _pairs(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}


def test_builtin_replica_runs_the_planned_engine_on_loopback() -> None:
    (model,) = load_fleet([])
    argv = replica_argv(model, 43210, threads=1)
    assert argv[:3] == [sys.executable, "-m", "fleetllm.cli"]
    assert argv[3:5] == ["engine", "serve"]
    flags = _pairs(argv)
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "43210"
    # The planned drain: engine.drainSeconds (60 by default).
    assert flags["--shutdown-grace-period"] == "60"
    assert flags["--num-threads"] == "1"
    # Every planned flag is there with its planned value, the address aside, and the threads:
    # planned for a pod's CPU request, here the fleet's share of this machine's cores.
    planned = _pairs(list(model.plan.args))
    assert planned["--num-threads"] == "2"
    assert list(argv).count("--num-threads") == 1
    for flag, value in planned.items():
        if flag not in ("--host", "--port", "--num-threads"):
            assert flags[flag] == value, flag
    assert flags["--model"] == "smollm2-135m" and flags["--device"] == "cpu"
    assert flags["--num-kv-blocks"] == str(model.plan.status.num_kv_blocks)


def test_without_a_local_thread_count_the_engine_finds_its_cores() -> None:
    (model,) = load_fleet([])
    assert "--num-threads" in model.plan.args  # planned for a pod
    assert "--num-threads" not in replica_argv(model, 43210, threads=None)


def test_extra_args_win_over_local_defaults(tmp_path: Path) -> None:
    model = _model(
        tmp_path,
        """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {name: smol}
spec:
  model: {name: smol, source: builtin://smollm2-135m}
  engine: {extraArgs: ["--num-threads=3"], drainSeconds: 7}
  gpu: {type: cpu}
""",
    )
    argv = replica_argv(model, 1234, threads=1)
    assert "--num-threads=3" in argv and "--num-threads" not in argv
    assert argv.count("--shutdown-grace-period") == 1
    assert _pairs(argv)["--shutdown-grace-period"] == "7"


def test_vllm_replica_runs_the_planned_vllm_server_on_the_pulled_weights(
    tmp_path: Path,
) -> None:
    model = _model(tmp_path, VLLM_TP2)
    argv = replica_argv(model, 5555, threads=None)
    # `vllm serve MODEL`, as planned, with this environment's vllm and the folder of the
    # local cache the hf:// source is pulled to (a pod's model cache volume).
    pulled = tmp_path / "cache" / "pulled" / "hf" / "Qwen" / "Qwen2.5-7B-Instruct" / "main"
    assert model.plan.model_path == str(pulled)
    assert argv[:5] == [*vllm_executable(VLLM), "serve", str(pulled)]
    flags = _pairs(argv)
    assert flags["--tensor-parallel-size"] == "2"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "5555"
    assert flags["--shutdown-timeout"] == "60"
    assert "--enable-prefix-caching" in argv
    # Our engine's flags are not vLLM's.
    assert "--shutdown-grace-period" not in argv and "--num-threads" not in argv
    assert model.devices_per_replica == 2

    env = replica_env(model, {"PATH": "/bin"}, ("2", "3"))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert env["PATH"] == "/bin"


def test_cpu_replicas_compute_on_disjoint_slots_of_the_cores() -> None:
    assert CorePool(range(16), 2).slots == (tuple(range(8)), tuple(range(8, 16)))
    assert CorePool([0, 1], 5).slots == ((0,), (1,))
    assert CorePool([3, 1, 2], 0).slots == ((1, 2, 3),)
    pool = CorePool([0, 1, 2, 3], 2)
    first, second = pool.take(), pool.take()
    assert (first, second) == ((0, 1), (2, 3))
    # A third replica (one draining beside its replacement) shares the least used slot.
    assert pool.take() == (0, 1)
    pool.give_back(second)
    assert pool.take() == (2, 3)


def test_gpu_pool_hands_out_whole_devices_and_takes_them_back() -> None:
    pool = GPUPool(["0", "1", "2"])
    first = pool.take(2)
    assert first == ("0", "1")
    assert pool.take(2) is None
    assert pool.take(1) == ("2",)
    pool.give_back(first)
    assert pool.take(3) is None
    assert pool.take(2) == ("0", "1")


@pytest.mark.parametrize("port", [1, 65535])
def test_the_address_is_replaced_not_added(port: int) -> None:
    (model,) = load_fleet([])
    argv = replica_argv(model, port, threads=None)
    assert argv.count("--port") == 1 and argv.count("--host") == 1
