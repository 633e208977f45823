#!/usr/bin/env bash
# Builds (and with --push, pushes) every image the manifests and the renderer refer to, tagged
# from fleetllm/version.py, or only the IMAGEs named. Needs docker with buildx; run from anywhere.
#   scripts/build-images.sh [--push] [--platform linux/amd64,linux/arm64] [IMAGE ...]
set -euo pipefail
cd "$(dirname "$0")/.."

push=()
platform=()
only=()
while [ $# -gt 0 ]; do
    case "$1" in
        --push) push=(--push); shift ;;
        --platform) platform=(--platform "$2"); shift 2 ;;
        -*) echo "usage: $0 [--push] [--platform LIST] [IMAGE ...]" >&2; exit 2 ;;
        *) only+=("$1"); shift ;;
    esac
done

# fleetllm must be importable (scripts/setup.sh installs it into .venv).
python=${PYTHON:-.venv/bin/python}
version=$("$python" -c 'from fleetllm.version import __version__; print(__version__)')
# One "DOCKERFILE IMAGE" line per image this repository builds.
images=$("$python" -m fleetllm.images)
for wanted in "${only[@]}"; do
    grep -q " $wanted\$" <<< "$images" || { echo "build: $wanted is not built here" >&2; exit 2; }
done
while read -r dockerfile image; do
    if [ ${#only[@]} -gt 0 ] && ! printf '%s\n' "${only[@]}" | grep -qxF "$image"; then
        continue
    fi
    echo "build: $image from $dockerfile" >&2
    docker buildx build "${platform[@]}" "${push[@]}" --file "$dockerfile" \
        --build-arg "VERSION=$version" --tag "$image" .
done <<< "$images"
