"""Engine fixtures: tiny random checkpoints and SmolLM2-135M, each built or loaded once."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tinymodels import write_tiny_model

from fleetllm.engine.cuda_graphs import DecodeGraphs
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.model_runner import ModelRunner
from fleetllm.engine.triton_attention import TritonPagedAttention


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Factory: variant name -> (checkpoint dir, the Hugging Face model), cached per session."""
    made: dict[tuple[str, str | None], tuple[Path, torch.nn.Module]] = {}

    def make(variant: str, max_shard_size: str | None = None) -> tuple[Path, torch.nn.Module]:
        key = (variant, max_shard_size)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{variant}-{max_shard_size or 'single'}")
            made[key] = write_tiny_model(path, variant, max_shard_size=max_shard_size)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir: Path) -> LLM:
    """SmolLM2 in float32, the dtype in which batched and single results agree exactly."""
    return LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=512, max_model_len=2048)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


_ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()  # every engine still alive
_CREATED: list[LLMEngine] = []  # engines made by the running test, kept until it is checked


@pytest.fixture(autouse=True, scope="session")
def _track_engines() -> Iterator[None]:
    original = LLMEngine.__init__

    def init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        _ENGINES.add(self)
        _CREATED.append(self)

    LLMEngine.__init__ = init  # type: ignore[method-assign]
    yield
    LLMEngine.__init__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def no_leaked_blocks(_track_engines: None) -> Iterator[None]:
    """After every test, each engine it made or could reach has no requests left and every
    KV block free."""
    _CREATED.clear()
    yield
    engines = {id(e): e for e in [*_CREATED, *_ENGINES]}
    _CREATED.clear()
    for engine in engines.values():
        assert not engine.has_unfinished_requests(), "a test left requests in the engine"
        assert engine.kv.usage() == 0.0, "KV blocks leaked"


@pytest.fixture
def eager_graphs() -> Callable[[ModelRunner], list[int]]:
    """Puts the GPU path on an engine's runner, as the CPU can run it: the Triton attention
    kernels (in Triton's interpreter) and the CUDA-graph runner (buckets 1, 2, 4, 8), its padded
    static-buffer forward run eagerly (capture=False); returns the list of the decode batch
    sizes the graph runner will run, in order."""

    def install(runner: ModelRunner) -> list[int]:
        attn = runner.model.attention
        runner.model.set_attention(
            TritonPagedAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
        )
        graphs = DecodeGraphs(
            runner.model,
            runner.kv_caches,  # type: ignore[arg-type]  # plain tensors: no quantized cache
            runner.block_size,
            runner.block_tables.width,
            sizes=[1, 2, 4, 8],
            device=torch.device("cpu"),
            capture=False,
        )
        ran: list[int] = []
        original = graphs.run

        def run(*args: list) -> torch.Tensor:
            ran.append(len(args[0]))
            return original(*args)

        graphs.run = run  # type: ignore[method-assign]
        runner.graphs = graphs
        return ran

    return install
