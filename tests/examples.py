"""The example manifests, and which of them a cluster can run.

smollm2-cpu-vllm.yaml serves the built-in model with vLLM, which only `fleetllm up` can do (it
converts the model's GGUF file into a folder vLLM loads); in a cluster the built-in model
ships only in fleetllm's engine image, and the planner refuses that source for vLLM.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
LOCAL_ONLY = (ROOT / "manifests" / "examples" / "smollm2-cpu-vllm.yaml",)
CLUSTER_EXAMPLES = [path for path in ALL_EXAMPLES if path not in LOCAL_ONLY]
