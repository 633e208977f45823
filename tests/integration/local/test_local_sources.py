"""An hf:// source on one machine: pulled into the local cache before the replicas start, as
the operator's init container pulls it into a pod (with the spec's engine.env: the hub's
address here), and served by the builtin engine from there. The model scales to zero when
idle, and the router's demand brings a replica back while the request waits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from local_testkit import Up, fake_hub, snapshot, survivors

from fleetllm.engine.model_files import cache_root

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
  engine:
    env:
    - name: HF_ENDPOINT
      value: {hub}
  gpu:
    type: cpu
  maxModelLen: 1024
  pod:
    resources:
      limits:
        memory: 768Mi
  scaling:
    minReplicas: 0
    maxReplicas: 1
    scaleToZeroAfterSeconds: 1
"""


def test_an_hf_model_is_pulled_served_scaled_to_zero_and_brought_back_on_demand(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "hub.yaml"
    cache = tmp_path / "cache"
    folder = cache / "pulled" / "hf" / "acme" / "tiny-chat" / "main"
    # The CPU attention kernels already built in the usual cache (their build is
    # tests/unit/engine/test_cpu_attention.py's): without them, the first replica would
    # compile its kernel into this cache, half a minute.
    if (cache_root() / "kernels").is_dir():
        shutil.copytree(cache_root() / "kernels", cache / "kernels")
    with fake_hub(REPO, tiny_model_dir) as hub:
        manifest.write_text(HF_FLEET.replace("{hub}", hub))
        up = Up(["-f", str(manifest)], tmp_path / "up", env={"FLEETLLM_CACHE_DIR": str(cache)})
        try:
            up.wait_for("replica ready", guard_s=180)
            (idle,) = up.wait_for("scale", to=0)
            assert "scaleToZeroAfterSeconds 1" in idle["reason"]
            up.wait_for("replica stopped")
            # No replica now: the request is held while the router's demand brings one back.
            answer = up.client().chat.completions.create(
                model="tiny-from-hub",
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=4,
            )
            assert answer.choices[0].message.content
            (back,) = up.find("scale", to=1)
            assert back["reason"] == "the router holds requests for it"
            # The replica loaded the pulled folder (the engine names it as the model's root).
            started = up.find("replica starting")
            assert len(started) == 2
            listed = httpx.get(f"{started[-1]['url']}/v1/models", timeout=30).json()
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
