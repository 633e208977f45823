"""The engine started with the planner's arguments holds exactly the KV cache the plan reports:
the same block count, the same bytes per token, on the planned device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from fleetllm.api.catalog import GPU_TYPES
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.cli import build_parser
from fleetllm.engine.cli import config_from_args
from fleetllm.engine.config import DTYPES, EngineConfig, ModelConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.planner.plan import plan

ROOT = Path(__file__).resolve().parents[3]


def _engine_config(args: Sequence[str]) -> EngineConfig:
    """What `fleetllm engine serve` makes of the planned arguments."""
    return config_from_args(build_parser().parse_args(["engine", "serve", *args]))


def test_the_engine_allocates_the_planned_kv_cache() -> None:
    (cr,) = load_llmdeployments(ROOT / "manifests" / "examples" / "smollm2-cpu.yaml")
    planned = plan(cr.spec)
    status = planned.status
    config = _engine_config(planned.args)
    assert config.device == status.device == "cpu"
    engine = LLMEngine(config)
    assert engine.kv.num_blocks == status.num_kv_blocks
    assert engine.max_model_len == status.max_model_len
    per_token = engine.model_config.kv_bytes_per_token(engine.dtype)
    assert per_token == status.kv_bytes_per_token
    allocated = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
    # The pool the plan counts, plus the engine's one null block (padding rows read it).
    usable = status.max_concurrent_tokens * status.kv_bytes_per_token
    assert allocated == usable + status.block_size * per_token
    assert all(k.device.type == "cpu" for k, _ in engine.runner.kv_caches)


def test_a_gpu_plan_counts_kv_bytes_as_the_engine_does(smollm2_dir: Path) -> None:
    """On a GPU the builtin engine gets --device cuda, the planned dtype and block count; its
    bytes per token follow the same formula (checked here on the checkpoint's config)."""
    model = ModelConfig.from_pretrained(smollm2_dir)
    for gpu in ("L4", "T4", "H100-80GB"):
        spec = LLMDeploymentSpec.model_validate(
            {
                "model": {"name": "smollm2-135m", "source": "builtin://smollm2-135m"},
                "gpu": {"type": gpu},
                "maxModelLen": 8192,
            }
        )
        planned = plan(spec)
        config = _engine_config(planned.args)
        assert config.device == "cuda" and GPU_TYPES[gpu].is_gpu
        assert config.num_kv_blocks == planned.status.num_kv_blocks
        dtype: torch.dtype = DTYPES[config.dtype]
        assert model.kv_bytes_per_token(dtype) == planned.status.kv_bytes_per_token
