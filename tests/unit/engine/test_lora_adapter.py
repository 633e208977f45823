"""Reading PEFT adapters: the scaling folded into B (plain, rsLoRA, per-module patterns), the
key that identifies an adapter by content, and every way of being unservable refused with a
LoRAAdapterError that says why, never another exception (fuzzed)."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loras import ALL_MODULES, adapter_tensors, write_adapter

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.lora_adapter import (
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
    check_path,
    load_adapter,
)

HF = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CFG = ModelConfig.from_dict(HF)
PREFIX = "base_model.model.model.layers"


def test_scaling_is_folded_into_b(tmp_path: Path) -> None:
    tensors = adapter_tensors(HF, 4)
    write_adapter(tmp_path / "plain", tensors, 4, lora_alpha=12)
    write_adapter(tmp_path / "rs", tensors, 4, lora_alpha=12, use_rslora=True)
    plain = load_adapter("plain", str(tmp_path / "plain"), CFG, 8)
    rs = load_adapter("rs", str(tmp_path / "rs"), CFG, 8)
    b = tensors[f"{PREFIX}.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(plain.weights[(1, "down_proj")][1], b * (12 / 4))
    assert torch.equal(rs.weights[(1, "down_proj")][1], b * (12 / math.sqrt(4)))
    assert torch.equal(
        plain.weights[(0, "q_proj")][0], tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"]
    )
    assert plain.rank == 4 and len(plain.weights) == 2 * len(ALL_MODULES)


def test_rank_and_alpha_patterns_apply_per_module(tmp_path: Path) -> None:
    tensors = adapter_tensors(HF, 4)
    # Layer 1's o_proj at rank 8: its tensors are that wide.
    wide = adapter_tensors(HF, 8, ("o_proj",), seed=1)
    for kind in ("A", "B"):
        key = f"{PREFIX}.1.self_attn.o_proj.lora_{kind}.weight"
        tensors[key] = wide[key]
    write_adapter(
        tmp_path, tensors, 4, lora_alpha=8,
        rank_pattern={"layers.1.self_attn.o_proj": 8}, alpha_pattern={"v_proj": 2},
    )  # fmt: skip
    adapter = load_adapter("p", str(tmp_path), CFG, 8)
    assert adapter.rank == 8
    o_b = tensors[f"{PREFIX}.1.self_attn.o_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(1, "o_proj")][1], o_b * (8 / 8))
    v_b = tensors[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(0, "v_proj")][1], v_b * (2 / 4))
    # The rank over the maximum counts, even where only a pattern reaches it.
    with pytest.raises(LoRAAdapterError, match="LoRA rank 8 is greater than max_lora_rank 4"):
        load_adapter("p", str(tmp_path), CFG, 4)


def test_the_key_follows_the_content_not_the_name(tmp_path: Path) -> None:
    tensors = adapter_tensors(HF, 4)
    first = load_adapter("a", str(write_adapter(tmp_path / "a", tensors, 4)), CFG, 8)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    same = load_adapter("b", str(tmp_path / "b"), CFG, 8)
    tensors[f"{PREFIX}.0.mlp.up_proj.lora_B.weight"][0, 0] += 1
    changed = load_adapter("c", str(write_adapter(tmp_path / "c", tensors, 4)), CFG, 8)
    assert first.key == same.key != changed.key
    write_adapter(tmp_path / "d", adapter_tensors(HF, 4), 4, lora_alpha=4)
    assert load_adapter("d", str(tmp_path / "d"), CFG, 8).key != first.key  # config counts


def _corrupt(kind: str, path: Path) -> None:
    """Write an adapter that is wrong in one way into `path`."""
    r = 16 if kind == "rank over the maximum" else 4
    tensors = adapter_tensors(HF, r)
    if kind == "wrong shape":
        tensors[f"{PREFIX}.0.self_attn.k_proj.lora_B.weight"] = torch.zeros(32, 4)
    elif kind == "missing B":
        del tensors[f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"]
    elif kind == "unsupported tensor":
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 32)
    elif kind == "layer past the model":
        tensors[f"{PREFIX}.2.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 32)
    elif kind == "integer weights":
        tensors[f"{PREFIX}.0.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 32, dtype=torch.int32)
    elif kind == "non-finite":
        tensors[f"{PREFIX}.0.mlp.up_proj.lora_A.weight"][0, 0] = float("nan")
    config: dict[str, object] = {
        "unsupported target": {"target_modules": ["q_proj", "lm_head"]},
        "DoRA": {"use_dora": True},
        "trained bias": {"bias": "all"},
        "PiSSA": {"init_lora_weights": "pissa"},
        "not LoRA": {"peft_type": "IA3"},
        "infinite alpha": {"lora_alpha": float("inf")},
    }.get(kind, {})
    write_adapter(path, tensors, r, **config)
    if kind == "missing config":
        (path / "adapter_config.json").unlink()
    elif kind == "missing weights":
        (path / "adapter_model.safetensors").unlink()
    elif kind == "pickled weights":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    elif kind == "not safetensors":
        (path / "adapter_model.safetensors").write_bytes(b"PK\x03\x04 a zip, say")
    elif kind == "config not JSON":
        (path / "adapter_config.json").write_text("r: 4")


CORRUPTIONS = {
    "wrong shape": "k_proj.lora_B.weight has shape (32, 4), expected (16, 4)",
    "missing B": "gate_proj has no lora_B.weight",
    "unsupported tensor": "modules the engine does not adapt: base_model.model.lm_head",
    "layer past the model": "the model has 2 layers",
    "integer weights": "torch.int32, not floating",
    "non-finite": "holds non-finite values",
    "rank over the maximum": "LoRA rank 16 is greater than max_lora_rank 8",
    "unsupported target": "target_modules ['lm_head'] are not supported",
    "DoRA": "DoRA",
    "trained bias": "bias='all'",
    "PiSSA": "init_lora_weights='pissa'",
    "not LoRA": "peft_type 'IA3' is not supported",
    "infinite alpha": "lora_alpha must be a finite number",
    "missing config": "the adapter folder has no adapter_config.json",
    "missing weights": "the adapter folder has no adapter_model.safetensors",
    "pickled weights": "adapter_model.bin (a pickle) is not loaded",
    "not safetensors": "adapter_model.safetensors is not a safetensors file",
    "config not JSON": "adapter_config.json is not valid JSON",
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_each_corruption_is_refused_with_its_reason(kind: str, tmp_path: Path) -> None:
    _corrupt(kind, tmp_path)
    with pytest.raises(LoRAAdapterError) as caught:
        load_adapter("bad", str(tmp_path), CFG, 8)
    assert CORRUPTIONS[kind] in str(caught.value)


def test_a_missing_folder_is_not_found_and_a_file_is_no_folder(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for"):
        load_adapter("x", str(tmp_path / "nothing"), CFG, 8)
    (tmp_path / "file").write_text("")
    with pytest.raises(LoRAAdapterError, match="is not a folder"):
        load_adapter("x", str(tmp_path / "file"), CFG, 8)


def test_paths_outside_the_allowed_roots_are_refused_links_included(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert check_path(str(root / "a"), [root]) == root / "a"
    for path in (outside, root / "link", root / ".." / "outside"):
        with pytest.raises(LoRAAdapterError, match="outside the allowed folders"):
            check_path(str(path), [root])
    assert check_path(str(outside), None) == outside


def test_an_oversized_weights_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    write_adapter(tmp_path, adapter_tensors(HF, 4), 4)
    with open(tmp_path / "adapter_model.safetensors", "ab") as f:
        f.truncate(64 << 20)
    with pytest.raises(LoRAAdapterError, match="more than an adapter of this model can hold"):
        load_adapter("big", str(tmp_path), CFG, 8)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = st.sampled_from(
    ["r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
     "bias", "init_lora_weights", "modules_to_save", "peft_type", "use_dora"]
)  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(overrides=st.dictionaries(_FIELDS, _JSON, max_size=4), weights=st.binary(max_size=64))
def test_fuzzed_configs_and_weights_load_or_are_refused_with_a_reason(
    tmp_path_factory: pytest.TempPathFactory, overrides: dict[str, object], weights: bytes
) -> None:
    path = tmp_path_factory.mktemp("fuzz")
    write_adapter(path, adapter_tensors(HF, 4), 4)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **overrides}))
    with contextlib.suppress(LoRAAdapterError):
        load_adapter("fuzz", str(path), CFG, 8)
    if weights:
        (path / "adapter_model.safetensors").write_bytes(weights)
        with pytest.raises(LoRAAdapterError):
            load_adapter("fuzz", str(path), CFG, 8)
