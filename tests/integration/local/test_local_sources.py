"""Model sources on one machine: an hf:// source is pulled into the local cache before the
replicas start (with progress), as the operator's init container pulls it into a pod, and the
builtin engine serves the pulled folder."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from local_testkit import Up, fake_hub, snapshot, survivors

REPO = "acme/tiny-chat"

HF_FLEET = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata:
  name: hub
spec:
  model:
    name: tiny-from-hub
    source: hf://acme/tiny-chat
    config:
      numLayers: 2
      hiddenSize: 64
      numHeads: 4
      numKVHeads: 2
      vocabSize: 49152
      maxPositionEmbeddings: 2048
      intermediateSize: 128
      tiedEmbeddings: true
  gpu:
    type: cpu
  maxModelLen: 1024
  pod:
    resources:
      limits:
        memory: 768Mi
"""


def test_an_hf_source_is_pulled_into_the_local_cache_then_served(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "hub.yaml"
    manifest.write_text(HF_FLEET)
    cache = tmp_path / "cache"
    folder = cache / "pulled" / "hf" / "acme" / "tiny-chat" / "main"
    with fake_hub(REPO, tiny_model_dir) as hub:
        up = Up(
            ["-f", str(manifest)],
            tmp_path / "up",
            env={"HF_ENDPOINT": hub, "FLEETLLM_CACHE_DIR": str(cache)},
        )
        try:
            up.wait_for("replica ready", guard_s=180)
            answer = up.client().chat.completions.create(
                model="tiny-from-hub",
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=4,
            )
            assert answer.choices[0].message.content
            # The replica loaded the pulled folder (the engine names it as the model's root).
            (started,) = up.find("replica starting")
            listed = httpx.get(f"{started['url']}/v1/models", timeout=30).json()
            assert listed["data"][0]["root"] == str(folder)
            tree = snapshot(p.pid for p in up.tree())
            assert up.stop() == 0
            assert not survivors(tree)
        finally:
            up.close()
    assert (folder / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()
    assert json.loads((folder / ".fleetllm-pull.json").read_text())["source"] == f"hf://{REPO}"
