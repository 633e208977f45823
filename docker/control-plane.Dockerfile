# The control plane: `fleetllm operator run`, `fleetllm router serve` and `fleetllm model pull`
# (the init container that fills the model cache). It leaves out torch and every other
# dependency only the engine needs (docker/requirements.py).
#   docker build -f docker/control-plane.Dockerfile --build-arg VERSION=... -t ... .

FROM python:3.12.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/fleetllm
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/
RUN python docker/requirements.py control-plane > /tmp/requirements.txt \
    && /opt/fleetllm/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt
COPY fleetllm fleetllm
COPY engine engine
COPY operator operator
COPY router router
RUN /opt/fleetllm/bin/pip install --no-cache-dir --no-deps . \
    && /opt/fleetllm/bin/pip uninstall --yes pip

FROM python:3.12.11-slim-bookworm
ARG VERSION=dev
LABEL org.opencontainers.image.title="fleetllm-control-plane" \
      org.opencontainers.image.description="fleetllm operator, router and model puller" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 1000 fleetllm \
    && useradd --system --uid 1000 --gid fleetllm --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin fleetllm
COPY --from=build /opt/fleetllm /opt/fleetllm
ENV PATH=/opt/fleetllm/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Numeric, so that Kubernetes can check runAsNonRoot without a runAsUser (1000 is `fleetllm`).
USER 1000:1000
ENTRYPOINT ["fleetllm"]
CMD ["--help"]
