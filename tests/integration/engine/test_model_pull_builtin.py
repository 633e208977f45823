"""`fleetllm model pull builtin://smollm2-135m DIR`, the command of a vLLM pod's init container:
the built-in model's GGUF file converted into a Hugging Face folder that vLLM-style loaders
read (transformers' config and tokenizer, safetensors weights), once; the builtin engine loading
that folder proves it complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.weights.pull import MARKER

SOURCE = "builtin://smollm2-135m"


def _pull(folder: Path, *extra: str) -> tuple[int, list[dict[str, Any]], str]:
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm.cli", "model", "pull", SOURCE, str(folder), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ.copy(),
    )
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return result.returncode, lines, result.stderr


def test_the_init_command_converts_once_into_a_folder_vllm_style_loaders_read(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    folder = tmp_path / "models" / "builtin" / "smollm2-135m"
    code, lines, stderr = _pull(folder)
    assert code == 0, stderr
    assert [line["msg"] for line in lines] == ["converting", "pull complete"]
    names = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    # What vLLM reads first: the architecture from config.json, transformers' tokenizer.
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"
    with safe_open(str(folder / "model.safetensors"), "np") as weights:
        assert "model.embed_tokens.weight" in set(weights.keys())
    marker = json.loads((folder / MARKER).read_text())
    assert marker["source"] == SOURCE and set(marker["files"]) == names

    # Skipped the second time (another replica's pod), also when the cache is read-only.
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    for extra in ((), ("--read-only",)):
        code, lines, stderr = _pull(folder, *extra)
        assert code == 0, stderr
        assert [line["msg"] for line in lines] == ["already pulled"]
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps

    # The folder is complete: the builtin engine loads it and answers as from its own cache.
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = "The capital of France is"
    answers = []
    for model in (folder, smollm2_dir):
        llm = LLM(str(model), dtype="float32", num_kv_blocks=32, max_model_len=256)
        (output,) = llm.generate(prompt, params)
        answers.append(output.outputs[0].token_ids)
    assert answers[0] == answers[1] and len(answers[0]) > 0


def test_a_conversion_of_another_build_is_redone_and_a_read_only_cache_refused(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "smollm2"
    assert _pull(folder)[0] == 0
    marker = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps({**marker, "commit": "converter-0/old"}))
    code, lines, stderr = _pull(folder, "--read-only")
    assert code == 1 and "is read-only and does not hold builtin://smollm2-135m" in stderr
    (folder / ".fleetllm-convert-killed").mkdir()  # a pod killed while converting
    code, lines, stderr = _pull(folder)
    assert code == 0, stderr
    assert [line["msg"] for line in lines] == ["converting", "pull complete"]
    assert json.loads((folder / MARKER).read_text()) == marker
    assert not list(folder.glob(".fleetllm-convert-*"))
