"""dtype auto for cpu replicas: planned the way the engine's auto resolves on the node."""

from __future__ import annotations

import argparse

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.operator.cli import add_config_arguments, config_from_args
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig

SMOLLM2 = {"name": "s", "source": "builtin://smollm2-135m"}


def cpu_spec(dtype: str = "auto") -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(
        {"model": SMOLLM2, "gpu": {"type": "cpu"}, "engine": {"dtype": dtype}}
    )


def test_cpu_auto_is_float32_unless_the_nodes_have_native_bf16() -> None:
    plain = plan(cpu_spec()).status
    bf16 = plan(cpu_spec(), OperatorConfig(cpu_bf16=True)).status
    assert plain.dtype == "float32"
    assert bf16.dtype == "bfloat16"
    # SmolLM2-135M: 30 layers, 3 KV heads of 64.
    assert plain.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert bf16.kv_bytes_per_token == plain.kv_bytes_per_token // 2
    assert bf16.weights_gib < plain.weights_gib
    assert bf16.num_kv_blocks > plain.num_kv_blocks
    assert bf16.engine_args[bf16.engine_args.index("--dtype") + 1] == "bfloat16"


def test_explicit_cpu_dtypes_are_kept() -> None:
    for config in (OperatorConfig(), OperatorConfig(cpu_bf16=True)):
        assert plan(cpu_spec("float32"), config).status.dtype == "float32"
        assert plan(cpu_spec("bfloat16"), config).status.dtype == "bfloat16"


def test_the_cli_flag_sets_it() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args(["--cpu-bf16"])).cpu_bf16
    assert not config_from_args(parser.parse_args([])).cpu_bf16
