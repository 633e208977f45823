#!/usr/bin/env bash
# Builds every image the manifests and the renderer refer to, tagged from fleetllm/version.py
# (the model-pull image from fleetllm.images.MODEL_PULL_VERSION), or only the IMAGEs named.
# Needs docker with buildx; run from anywhere. Runs on macOS's bash 3.2: no arrays, no
# associative arrays, no ${x,,}, no mapfile.
#   scripts/build-images.sh [--registry REGISTRY] [--push | --load] [--platform LIST]
#                           [--dry-run] [IMAGE ...]
#   --registry R  tag for your registry: ghcr.io/fleetllm/engine:V becomes R/fleetllm/engine:V
#                 (install the chart with --set global.imageRegistry=R)
#   --push        push each image after building it (to R: you must be able to push there)
#   --load        load each image into the local docker (for `kind load docker-image`);
#                 one platform only
#   --dry-run     print the docker commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    echo "usage: $0 [--registry REGISTRY] [--push | --load] [--platform LIST] [--dry-run] [IMAGE ...]"
}

output=""
platform=""
registry=""
dry_run=0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --push | --load)
            if [ -n "$output" ] && [ "$output" != "$1" ]; then
                echo "build: --push and --load exclude each other" >&2
                exit 2
            fi
            output=$1
            shift
            ;;
        --platform | --registry)
            if [ $# -lt 2 ]; then
                usage >&2
                exit 2
            fi
            if [ "$1" = --platform ]; then platform=$2; else registry=$2; fi
            shift 2
            ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) usage >&2; exit 2 ;;
        *) only="$only$1 "; shift ;;
    esac
done
case "$platform" in
    *,*)
        if [ "$output" = --load ]; then
            echo "build: --load takes one platform (docker loads one); got $platform" >&2
            exit 2
        fi
        ;;
esac

# fleetllm must be importable (scripts/setup.sh installs it into .venv).
python=${PYTHON:-.venv/bin/python}
version=$("$python" -c 'from fleetllm.version import __version__; print(__version__)')
# One "DOCKERFILE IMAGE" line per image this repository builds (moved to the registry).
if [ -n "$registry" ]; then
    images=$("$python" -m fleetllm.images "$registry")
else
    images=$("$python" -m fleetllm.images)
fi
for wanted in $only; do
    if ! printf '%s\n' "$images" | grep -q " $wanted\$"; then
        echo "build: $wanted is not built here; these are:" >&2
        printf '%s\n' "$images" | sed 's/^[^ ]* /  /' >&2
        exit 2
    fi
done
printf '%s\n' "$images" | while read -r dockerfile image; do
    if [ -n "$only" ]; then
        case " $only" in
            *" $image "*) ;;
            *) continue ;;
        esac
    fi
    set -- buildx build
    if [ -n "$platform" ]; then set -- "$@" --platform "$platform"; fi
    if [ -n "$output" ]; then set -- "$@" "$output"; fi
    set -- "$@" --file "$dockerfile" --build-arg "VERSION=$version" --tag "$image" .
    echo "build: $image from $dockerfile" >&2
    if [ "$dry_run" = 1 ]; then
        echo "docker $*"
    else
        docker "$@"
    fi
done
