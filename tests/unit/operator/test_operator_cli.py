"""`fleetllm plan`, `render` and `crds`: readable output, clear errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleetllm.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "manifests" / "examples"

REFUSED = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata:
  name: llama-70b-2gpu
spec:
  model:
    name: llama-70b
    source: hf://meta-llama/Llama-3.1-70B-Instruct
  engine:
    backend: vllm
  parallelism:
    tensor: 2
  gpu:
    type: H100-80GB
"""


def test_plan_prints_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(EXAMPLES / "llama-3.1-8b-h100.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-8b (model llama-3.1-8b): planned\n")
    for line in (
        "hardware       1 x H100-80GB, backend builtin on cuda",
        "KV cache       56.63 GiB per device, bfloat16, 131072 bytes/token",
        "x 131,072-token sequences",
        "command        fleetllm engine serve --model",
    ):
        assert line in out


def test_plan_json_and_yaml_carry_the_status_plan(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "llama-3.1-70b-h100-tp4.yaml")
    assert main(["plan", "-f", path, "-o", "json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["planned"] is True
    assert record["plan"]["gpuCount"] == 4
    assert record["plan"]["kvCacheDtype"] == "fp8"
    assert main(["plan", "-f", path, "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == [record]


def test_plan_reports_a_refusal_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(REFUSED)
    assert main(["plan", "-f", str(path)]) == 1
    out = capsys.readouterr().out
    assert "llama-70b-2gpu (model llama-70b): REFUSED (KVCacheTooSmall)" in out
    assert "parallelism.tensor: 4 (4 x H100-80GB)" in out
    assert main(["plan", "-f", str(path), "-o", "json"]) == 1
    (record,) = json.loads(capsys.readouterr().out)
    assert record["planned"] is False
    assert record["reason"] == "KVCacheTooSmall"


def test_render_prints_multi_document_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(EXAMPLES / "smollm2-cpu.yaml")]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == [
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Secret",
    ]
    config = json.loads(docs[0]["data"]["engine.json"])
    assert config["plan"]["maxModelLen"] == 8192
    assert "ownerReferences" not in docs[0]["metadata"]  # no cluster, no owner uid


def test_render_refuses_an_unplannable_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(REFUSED)
    assert main(["render", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "llama-70b-2gpu: not rendered, plan refused (KVCacheTooSmall)" in captured.err


def test_render_refuses_extra_args_vllms_parser_refuses_with_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "apiVersion: fleetllm.io/v1alpha1\nkind: LLMDeployment\nmetadata: {name: llama}\n"
        "spec:\n  model: {name: llama, source: hf://meta-llama/Llama-3.1-8B-Instruct}\n"
        "  gpu: {type: H100-80GB}\n  maxModelLen: 8192\n"
        "  engine: {backend: vllm, extraArgs: [--max-num-seqs, many]}\n"
    )
    assert main(["render", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "llama: not rendered, plan refused (InvalidEngineArgs)" in captured.err
    assert "argument --max-num-seqs: invalid int value: 'many'" in captured.err


def test_crds_prints_the_checked_in_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds"]) == 0
    checked_in = (ROOT / "crds" / "fleetllm.io_llmdeployments.yaml").read_text()
    assert capsys.readouterr().out == checked_in


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("spec: [unclosed", "not valid YAML"),
        ("", "no LLMDeployment in the file"),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "not an LLMDeployment"),
        ("- a\n- b\n", "expected a mapping"),
        (
            REFUSED.replace("tensor: 2", "tensor: two"),
            "LLMDeployment llama-70b-2gpu: spec.parallelism.tensor: "
            "Input should be a valid integer",
        ),
        (REFUSED.replace("  gpu:\n    type: H100-80GB\n", ""), "spec.gpu: Field required"),
        (
            REFUSED.replace("    backend: vllm", "    backend: vllm\n    replica: 2"),
            "spec.engine.replica: Extra inputs are not permitted",
        ),
        (
            REFUSED + "---\n" + REFUSED.replace("name: llama-70b-2gpu", "name: Bad_Name"),
            "(document 2): LLMDeployment Bad_Name: metadata.name: String should match pattern",
        ),
    ],
    ids=["missing", "yaml", "empty", "kind", "list", "type", "required", "unknown", "second"],
)
@pytest.mark.parametrize("command", ["plan", "render"])
def test_bad_files_give_a_clear_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    content: str | None,
    message: str,
) -> None:
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    assert main([command, "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fleetllm: error: {path}")
    assert message in err
    assert "Traceback" not in err


def test_operator_run_without_credentials_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    assert main(["operator", "run", "-n", "default"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetllm: error: cannot log in to Kubernetes")
    assert "missing-kubeconfig" in err


def test_render_takes_the_operators_cluster_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = str(EXAMPLES / "llama-3.2-3b-l4-gke.yaml")
    args = ["render", "-f", example, "--gpu-profile", "karpenter", "--model-cache-claim", "cache"]
    assert main(args) == 0
    (deployment,) = [
        d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Deployment"
    ]
    pod = deployment["spec"]["template"]["spec"]
    # The example's own profile (gke) wins over the operator's; the cache claim is used.
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-l4"
    assert "karpenter.k8s.aws/instance-gpu-name" not in pod["nodeSelector"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "cache"}

    assert main(["render", "-f", example, "--model-cache-read-only"]) == 2
    assert "--model-cache-read-only needs --model-cache-claim" in capsys.readouterr().err
    assert main(["render", "-f", example, "--model-cache-claim", "Bad_Name"]) == 2
    assert "not a valid claim name" in capsys.readouterr().err
