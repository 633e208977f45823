"""The example manifests; a cluster runs every one of them (smollm2-cpu-vllm.yaml serves the
built-in model with vLLM: an init container converts its GGUF file into the model cache)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
VLLM_BUILTIN = ROOT / "manifests" / "examples" / "smollm2-cpu-vllm.yaml"
"""The built-in model served by vLLM's CPU image."""
