"""A builtin engine on a CPU computes on the cores its pod requests, not on every core of its
node: the planner gives it `--num-threads`, which the pod's own request decides."""

from __future__ import annotations

from typing import Any

import pytest

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.cli import build_parser
from fleetllm.planner.plan import plan


def cpu_spec(**fields: Any) -> LLMDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"name": "smol", "source": "builtin://smollm2-135m"},
        "gpu": {"type": "cpu"},
    }
    body.update(fields)
    return LLMDeploymentSpec.model_validate(body)


def threads_of(args: tuple[str, ...]) -> int:
    """The thread count the engine's own parser reads from the planned command line."""
    return build_parser().parse_args(["engine", "serve", *args]).num_threads


@pytest.mark.parametrize(
    ("fields", "threads"),
    [
        ({}, 2),  # the planned request: two cores
        ({"pod": {"resources": {"requests": {"cpu": "8"}}}}, 8),
        ({"pod": {"resources": {"requests": {"cpu": "3500m"}}}}, 3),
        ({"pod": {"resources": {"requests": {"cpu": "500m"}}}}, 1),
        ({"parallelism": {"tensor": 3}}, 1),  # a core per rank, each rank its share
        ({"parallelism": {"tensor": 3}, "pod": {"resources": {"requests": {"cpu": "12"}}}}, 4),
    ],
)
def test_cpu_replicas_compute_on_the_cores_their_pod_requests(fields, threads):
    assert threads_of(plan(cpu_spec(**fields)).args) == threads


def test_threads_given_in_extra_args_are_the_engines():
    planned = plan(cpu_spec(engine={"extraArgs": ["--num-threads=5"]}))
    assert threads_of(planned.args) == 5
    assert sum(arg.startswith("--num-threads") for arg in planned.args) == 1


def test_gpu_replicas_and_vllm_get_no_thread_count():
    gpu = plan(
        LLMDeploymentSpec.model_validate(
            {"model": {"name": "m", "source": "builtin://smollm2-135m"}, "gpu": {"type": "L4"}}
        )
    )
    vllm = plan(cpu_spec(engine={"backend": "vllm"}))
    assert "--num-threads" not in gpu.args and "--num-threads" not in vllm.args
