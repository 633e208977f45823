# fleetllm's engine on NVIDIA GPUs: the CUDA build of torch, whose wheels carry the CUDA
# runtime libraries; the node's driver comes in through the NVIDIA container runtime.
# For linux/arm64 nodes (GH200), pass --build-arg TORCH_INDEX_URL=<PyTorch's CUDA index>:
# PyPI's arm64 torch wheels are CPU-only.
#   docker build -f docker/engine-cuda.Dockerfile --build-arg VERSION=... -t ... .

FROM python:3.12.11-slim-bookworm AS build
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/fleetllm \
    && /opt/fleetllm/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/
RUN python docker/requirements.py engine > /tmp/requirements.txt \
    && /opt/fleetllm/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt
COPY fleetllm fleetllm
COPY engine engine
COPY operator operator
COPY router router
RUN /opt/fleetllm/bin/pip install --no-cache-dir --no-deps . \
    && /opt/fleetllm/bin/pip uninstall --yes pip

FROM python:3.12.11-slim-bookworm
ARG VERSION=dev
LABEL org.opencontainers.image.title="fleetllm-engine-cuda" \
      org.opencontainers.image.description="fleetllm engine for NVIDIA GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles a small C launcher per kernel at its first launch with the system compiler
# (and Python's headers, which this base image has): without gcc every Triton kernel fails to
# build. bookworm's gcc is fixed by the release; libc6-dev must match the image's libc6, which
# a pin would break at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 1000 fleetllm \
    && useradd --system --uid 1000 --gid fleetllm --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin fleetllm
COPY --from=build /opt/fleetllm /opt/fleetllm
# The driver's libraries (libcuda.so.1): the NVIDIA container toolkit (EKS, the GPU operator)
# puts them on the linker's path itself, but GKE's device plugin only mounts them at
# /usr/local/nvidia/lib64 and leaves finding them to the image (as NVIDIA's CUDA images do):
# without this path torch sees no GPU and Triton finds no libcuda there.
ENV PATH=/opt/fleetllm/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["fleetllm"]
CMD ["engine", "serve", "--help"]
