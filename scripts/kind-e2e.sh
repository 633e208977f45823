#!/usr/bin/env bash
# The cluster tier of the tests on a new kind cluster: scripts/kind-cluster.sh makes it (with
# the images of this checkout), tests/e2e runs on it (the Helm chart, docs/quickstart.md's
# cluster commands, scaling, autoscaling, deletion), and the cluster is deleted afterwards
# unless KEEP_CLUSTER=1. Needs docker and kind; helm and kubectl come from .venv/bin.
#   scripts/kind-e2e.sh [PYTEST ARGS ...]
set -euo pipefail
cd "$(dirname "$0")/.."

export CLUSTER=${CLUSTER:-fleetllm-e2e}
scripts/setup.sh
if [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    trap 'kind delete cluster --name "$CLUSTER"' EXIT
fi
scripts/kind-cluster.sh
kubeconfig=$(mktemp)
kind get kubeconfig --name "$CLUSTER" > "$kubeconfig"
KUBECONFIG="$kubeconfig" .venv/bin/pytest tests/e2e "$@"
