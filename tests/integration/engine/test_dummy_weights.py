"""load_format="dummy": a model from its config.json alone, with random weights (benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.llm import LLM
from fleetllm.engine.loader import load_model
from fleetllm.engine.model import RotaryEmbedding
from fleetllm.engine.sampling_params import SamplingParams

CONFIG = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_random_weights_from_a_config_alone(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))

    def make() -> LLM:
        return LLM(
            str(tmp_path),
            dtype="float32",
            load_format="dummy",
            skip_tokenizer_init=True,
            num_kv_blocks=16,
            max_model_len=64,
        )

    first, second = make(), make()
    # The weights as drawn, before the CPU's reordering of the linear layers.
    model = load_model(
        tmp_path,
        ModelConfig.from_pretrained(tmp_path),
        torch.float32,
        torch.device("cpu"),
        max_positions=64,
        load_format="dummy",
        pack=False,
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    w = model.model.layers[0].mlp.gate_up_proj.weight
    assert w.shape == (2 * 96, 64) and w.dtype == torch.float32
    assert 0.01 < float(w.detach().std()) < 0.03
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = [llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids for llm in (first, second)]
    assert outs[0] == outs[1] and len(outs[0]) == 5  # the same seed: the same weights
    embed = first.engine.model.model.embed_tokens.weight
    assert torch.equal(embed, model.model.embed_tokens.weight)


def test_unknown_load_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="npz", skip_tokenizer_init=True)


def test_rope_tables_are_computed_not_drawn(tmp_path: Path) -> None:
    """The random weights are drawn in the model's dtype; the RoPE tables stay the float32
    tables a model built on the CPU computes."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = load_model(
        tmp_path, cfg, torch.bfloat16, torch.device("cpu"), max_positions=64, load_format="dummy"
    )
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    fresh = RotaryEmbedding(cfg, 64)
    for name in ("cos", "sin"):
        table = getattr(model.model.rotary, name)
        assert table.dtype == torch.float32 and table.device.type == "cpu"
        assert torch.equal(table, getattr(fresh, name))


def test_building_the_model_imports_no_compiler(tmp_path: Path) -> None:
    """The loader builds the model on the meta device. Arithmetic on meta tensors would import
    torch._dynamo (seconds of every cold start) though nothing compiles: a fresh interpreter
    that loads a model has not imported it."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    script = f"""
import sys
from pathlib import Path
import torch
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.loader import load_model
assert "torch._dynamo" not in sys.modules, "importing torch alone imports the compiler"
folder = Path({str(tmp_path)!r})
load_model(folder, ModelConfig.from_pretrained(folder), torch.bfloat16, torch.device("cpu"),
           max_positions=64, load_format="dummy")
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
