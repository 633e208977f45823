#!/usr/bin/env bash
# A local kind cluster (https://kind.sigs.k8s.io) with fleetllm's control-plane and CPU engine
# images built from this checkout and loaded into it, and kubectl's current context set to it.
# Needs docker and kind. The cluster is named $CLUSTER (default: fleetllm); delete it with
#   kind delete cluster --name fleetllm
set -euo pipefail
cd "$(dirname "$0")/.."

cluster=${CLUSTER:-fleetllm}
images=$(.venv/bin/python -c 'from fleetllm.images import CONTROL_PLANE_IMAGE, ENGINE_IMAGE, MODEL_PULL_IMAGE
print(CONTROL_PLANE_IMAGE, ENGINE_IMAGE, MODEL_PULL_IMAGE)')

kind create cluster --name "$cluster"
# shellcheck disable=SC2086 # image references
scripts/build-images.sh --load $images
# shellcheck disable=SC2086
kind load docker-image $images --name "$cluster"
