"""load_format="dummy": a model from its config.json alone, with random weights (benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.llm import LLM
from fleetllm.engine.loader import load_model
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
