"""`fleetllm up` honours the LLMDeployment as a cluster does where one machine can (routing,
scaling bounds, engine args and env, dtype, maxModelLen, drainSeconds), and says what it
cannot honour instead of dropping it in silence."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from fleetllm.cli import main
from fleetllm.engine import cpu_features
from fleetllm.local.deployments import load_fleet, local_notes
from fleetllm.local.launch import CorePool, GPUPool, LocalModel, replica_argv, replica_env
from fleetllm.local.supervisor import ModelFleet, Supervisor, SupervisorSettings
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan

VLLM = Path("/opt/vllm/bin/python")


def _fleet(tmp_path: Path, spec: dict[str, Any], **kwargs: Any) -> LocalModel:
    doc = {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "m"},
        "spec": {"model": {"name": "m", "source": "builtin://smollm2-135m"}, **spec},
    }
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(doc))
    (model,) = load_fleet([path], vllm=VLLM, cache=tmp_path / "cache", **kwargs)
    return model


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}


CPU = {"gpu": {"type": "cpu"}}


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_dtype_auto_on_the_cpu_is_what_the_engines_auto_picks_on_this_machine(
    tmp_path: Path, native: bool, dtype: str
) -> None:
    model = _fleet(tmp_path, CPU, cpu_bf16=native)
    assert model.plan.status.dtype == dtype
    assert _flags(replica_argv(model, 1, threads=None))["--dtype"] == dtype
    # Given explicitly, a dtype stays as given.
    given = _fleet(tmp_path, {**CPU, "engine": {"dtype": "float32"}}, cpu_bf16=True)
    assert _flags(replica_argv(given, 1, threads=None))["--dtype"] == "float32"


@pytest.mark.parametrize(
    ("flags", "dtype", "itemsize"),
    [({"avx2", "fma"}, "float32", 4), ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", 2)],
)
def test_dtype_auto_follows_this_cpus_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: set[str], dtype: str, itemsize: int
) -> None:
    """Unless told, `fleetllm up` asks the engine's own capability probe, and the memory
    figures (weights, KV bytes per token) are those of the dtype it picks."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    status = _fleet(tmp_path, CPU).plan.status
    assert status.dtype == dtype
    assert status.kv_bytes_per_token == 2 * 30 * 3 * 64 * itemsize  # SmolLM2-135M
    given = _fleet(tmp_path, {**CPU, "engine": {"dtype": dtype}}).plan.status
    assert (status.weights_gib, status.num_kv_blocks) == (given.weights_gib, given.num_kv_blocks)
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    kept = _fleet(tmp_path, {**CPU, "engine": {"dtype": other}}).plan.status
    assert kept.dtype == other and kept.weights_gib != status.weights_gib


def test_engine_fields_reach_the_replica(tmp_path: Path) -> None:
    model = _fleet(
        tmp_path,
        {
            **CPU,
            "maxModelLen": 1024,
            "engine": {
                "dtype": "float32",
                "drainSeconds": 45,
                "extraArgs": ["--step-timeout=30"],
                "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            },
        },
    )
    argv = replica_argv(model, 4321, threads=2)
    flags = _flags(argv)
    assert flags["--max-model-len"] == "1024"
    assert flags["--dtype"] == "float32"
    assert flags["--served-model-name"] == "m"
    assert flags["--shutdown-grace-period"] == "45"  # engine.drainSeconds, as planned
    assert "--step-timeout=30" in argv
    assert replica_env(model, {}, None)["HF_HUB_OFFLINE"] == "1"


def test_routing_and_scaling_bounds_reach_the_router_and_the_supervisor(tmp_path: Path) -> None:
    routing = {"strategy": "session", "sessionHeader": "x-user", "loadFactor": 2.0}
    model = _fleet(
        tmp_path, {**CPU, "routing": routing, "scaling": {"minReplicas": 0, "maxReplicas": 3}}
    )
    route = ModelFleet(model, 1).route()
    assert route.routing is not None
    assert (route.routing.strategy, route.routing.session_header, route.routing.load_factor) == (
        "session",
        "x-user",
        2.0,
    )
    assert (model.min_replicas, model.max_replicas) == (0, 3)
    supervisor = Supervisor(
        [model], SupervisorSettings(tmp_path, "e"), gpus=GPUPool([]), cores=CorePool([0], 1)
    )
    supervisor.set_desired("m", 9, "test")
    assert supervisor.fleets["m"].desired == 3


def test_drain_seconds_bound_a_scale_down_and_the_grace_period_a_shutdown(
    tmp_path: Path,
) -> None:
    model = _fleet(tmp_path, {**CPU, "engine": {"drainSeconds": 90}})
    supervisor = Supervisor(
        [model],
        SupervisorSettings(tmp_path, "e", grace_s=20),
        gpus=GPUPool([]),
        cores=CorePool([0], 1),
    )
    fleet = supervisor.fleets["m"]
    assert supervisor.drain_time(fleet) == 90
    supervisor.stopping = True
    assert supervisor.drain_time(fleet) == 20
    assert local_notes(model.cr, 20) == [
        "engine.drainSeconds 90 is longer than --shutdown-grace-period 20: a scale-down "
        "drains a replica for up to 90s, but at shutdown open requests get 20s"
    ]
    assert local_notes(model.cr, 90) == []


def test_node_labels_are_not_asked_of_this_machine(tmp_path: Path) -> None:
    gpu = {"gpu": {"type": "A10G", "nodeSelectorProfile": "gke"}}
    model = _fleet(tmp_path, gpu)
    # The cluster refuses it: GKE has no label for that GPU.
    with pytest.raises(PlanError, match="gke node-selector profile has no label"):
        plan(model.cr.spec)
    assert model.plan.node_selector == {}
    assert local_notes(model.cr, 30) == [
        "gpu.nodeSelectorProfile picks cluster nodes; the replicas run on this machine"
    ]


def test_what_only_a_cluster_honours_is_named(tmp_path: Path) -> None:
    model = _fleet(
        tmp_path,
        {
            "gpu": {"type": "cpu"},
            "engine": {"image": "registry.example/engine:1", "imagePullPolicy": "Always"},
            "scaling": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "mode": "keda",
                "prometheusAddress": "http://prometheus:9090",
            },
            "pod": {
                "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
                "nodeSelector": {"pool": "cpu"},
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                "affinity": {"nodeAffinity": {}},
                "priorityClassName": "high",
                "serviceAccountName": "engine",
                "annotations": {"a": "b"},
            },
        },
    )
    notes = local_notes(model.cr, 60)
    assert notes == [
        "engine.image is for pods; the replicas run this environment's `fleetllm engine serve`",
        "engine.imagePullPolicy is for pods; the replicas run this environment's "
        "`fleetllm engine serve`",
        "pod.resources.requests.cpu applies to pods only",
        "pod.resources.limits.memory sizes the KV cache as in a pod, but nothing enforces it here",
        "pod.nodeSelector applies to pods only",
        "pod.tolerations applies to pods only",
        "pod.affinity applies to pods only",
        "pod.priorityClassName applies to pods only",
        "pod.serviceAccountName applies to pods only",
        "pod.annotations applies to pods only",
        "scaling.mode keda makes a KEDA ScaledObject in a cluster; here the builtin autoscaler "
        "scales between the same bounds on the same targets",
    ]
    # The memory limit of a cpu replica sizes its KV cache here too.
    assert model.plan.status.device_memory_gib == 4.0
    (default,) = load_fleet([])
    assert local_notes(default.cr, 30) == []


def test_fleetllm_up_prints_and_logs_the_notes_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _fleet(tmp_path, {**CPU, "engine": {"drainSeconds": 90}})
    started: list[Any] = []

    async def run_fleet(models: list[LocalModel], **kwargs: Any) -> int:
        started.append(models)
        return 0

    monkeypatch.setattr("fleetllm.local.cli.run_fleet", run_fleet)
    root, router = logging.getLogger(), logging.getLogger("fleetllm.router")
    saved = (root.handlers[:], root.level, router.handlers[:], router.propagate)
    try:
        code = main(["up", "-f", str(tmp_path / "m.yaml"), "--log-dir", str(tmp_path / "logs")])
    finally:
        for handler in {*root.handlers, *router.handlers} - {*saved[0], *saved[2]}:
            handler.close()
        root.handlers[:], router.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        router.propagate = saved[3]
    assert code == 0 and [m.name for m in started[0]] == [model.name]
    err = capsys.readouterr().err
    assert "note: engine.drainSeconds 90 is longer than --shutdown-grace-period 30" in err
    logged = [
        json.loads(line)
        for line in err.splitlines()
        if line.startswith("{") and "not done on this machine" in line
    ]
    assert logged and logged[0]["model"] == "m" and "drainSeconds 90" in logged[0]["note"]
