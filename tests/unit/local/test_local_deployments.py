"""What `fleetllm up` agrees to run: the built-in default, manifests planned by the operator's
planner (refusals read as `fleetllm plan` prints them), and what one machine cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetllm.cli import main
from fleetllm.local.deployments import (
    FleetError,
    check_gpus,
    load_fleet,
    local_gpus,
)
from fleetllm.local.vllm import vllm_executable

VLLM = Path("/opt/vllm/bin/python")
REFUSED = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {name: llama-70b-2gpu}
spec:
  model: {name: llama-70b, source: hf://meta-llama/Llama-3.1-70B-Instruct}
  engine: {backend: vllm}
  parallelism: {tensor: 2}
  gpu: {type: H100-80GB}
"""


def _manifest(name: str, source: str, **spec: object) -> str:
    doc = {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": name, "source": source}, "gpu": {"type": "cpu"}, **spec},
    }
    return json.dumps(doc)  # JSON is YAML


def _write(path: Path, *docs: str) -> Path:
    path.write_text("\n---\n".join(docs))
    return path


def test_the_default_is_smollm2_on_the_cpu_one_replica_two_under_load() -> None:
    (model,) = load_fleet([])
    assert model.name == "smollm2-135m"
    assert model.cr.spec.model.source == "builtin://smollm2-135m"
    assert model.plan.gpu.name == "cpu" and model.backend == "builtin"
    assert (model.min_replicas, model.initial_replicas, model.max_replicas) == (1, 1, 2)
    assert model.devices_per_replica == 0


def test_a_refused_plan_reads_as_fleetllm_plan_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "refused.yaml", REFUSED)
    assert main(["plan", "-f", str(path)]) == 1
    planned = capsys.readouterr().out.strip()
    assert "REFUSED (KVCacheTooSmall)" in planned
    with pytest.raises(FleetError) as caught:
        load_fleet([path], vllm=VLLM)
    assert planned in str(caught.value)

    assert main(["up", "-f", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fleetllm up: cannot start the fleet:\n")
    assert planned.splitlines()[0] in err and planned.splitlines()[1] in err


def test_vllm_without_vllm_installed_is_a_clear_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _manifest("qwen", "hf://Qwen/Qwen2.5-7B-Instruct", engine={"backend": "vllm"})
    text = text.replace('"type": "cpu"', '"type": "L4"')
    path = _write(tmp_path / "vllm.yaml", text)
    with pytest.raises(FleetError, match=r"vLLM's OpenAI server, which is not installed here"):
        load_fleet([path], vllm=None)
    (model,) = load_fleet([path], vllm=VLLM)
    assert model.backend == "vllm" and model.executable == vllm_executable(VLLM)

    monkeypatch.setenv("FLEETLLM_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert main(["up", "-f", str(path)]) == 1
    assert "FLEETLLM_WITH_VLLM=1 scripts/setup.sh" in capsys.readouterr().err


def test_every_problem_of_every_manifest_is_reported_at_once(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "many.yaml",
        _manifest("claim", "pvc://weights/smollm2-135m"),
        _manifest("secret", "builtin://smollm2-135m", engine={"env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
        ]}),
        _manifest("claim", "builtin://smollm2-135m"),
        _manifest("other", "builtin://smollm2-135m").replace(
            '"name": "other", "source"', '"name": "secret", "source"'
        ),
        _manifest("hub", "hf://HuggingFaceTB/SmolLM2-135M-Instruct"),
    )  # fmt: skip
    with pytest.raises(FleetError) as caught:
        load_fleet([path])
    lines = str(caught.value).splitlines()
    assert len(lines) == 4, "\n".join(lines)
    assert "the builtin engine cannot load a pvc:// source on this machine" in lines[0]
    assert "engine.env[0] (TOKEN): valueFrom" in lines[1]
    assert "a second LLMDeployment named claim" in lines[2]
    assert "model secret is already served by secret" in lines[3]
    # hf:// is fine: its weights are pulled into the local cache first.


def test_a_file_source_is_read_from_the_manifests_folder_and_sized_by_its_config(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 3,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 300,
                "max_position_embeddings": 512,
                "intermediate_size": 128,
                "tie_word_embeddings": True,
            }
        )
    )
    manifests = tmp_path / "deploy"
    manifests.mkdir()
    path = _write(manifests / "tiny.yaml", _manifest("tiny", "file://../models/tiny"))
    (model,) = load_fleet([path], cpu_bf16=False)
    assert model.cr.spec.model.source == f"file://{folder}"
    assert model.plan.arch.num_layers == 3 and model.plan.arch.num_kv_heads == 2
    assert model.plan.status.max_model_len == 512
    # 2 (K and V) x 3 layers x 2 KV heads x 16 dims x 4 bytes (float32 on a CPU without bf16)
    assert model.plan.status.kv_bytes_per_token == 768
    args = list(model.plan.args)
    assert args[args.index("--model") + 1] == str(folder)

    missing = _write(manifests / "missing.yaml", _manifest("gone", "file://nowhere"))
    with pytest.raises(FleetError, match=r"nowhere does not exist"):
        load_fleet([missing])


def test_file_sources_are_refused_in_a_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "f.yaml", _manifest("local", "file:///srv/models/llama-3.1-8b"))
    assert main(["plan", "-f", str(path)]) == 1
    assert "REFUSED (UnsupportedSource)" in capsys.readouterr().out


def test_gpus_come_from_cuda_visible_devices_when_it_is_set() -> None:
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == ["0", "2"]
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]


def test_a_fleet_needing_more_gpus_than_the_machine_has_is_refused(tmp_path: Path) -> None:
    text = _manifest("qwen", "hf://Qwen/Qwen2.5-7B-Instruct", engine={"backend": "vllm"})
    text = text.replace('"type": "cpu"', '"type": "L4"').replace(
        '"engine"', '"parallelism": {"tensor": 2}, "replicas": 2, "engine"'
    )
    (model,) = load_fleet([_write(tmp_path / "q.yaml", text)], vllm=VLLM)
    check_gpus([model], 4)
    with pytest.raises(FleetError, match=r"need 4 GPUs \(qwen: 2 x 2 L4\); this machine has 3"):
        check_gpus([model], 3)
