# syntax=docker/dockerfile:1
ARG PYTHON_IMAGE=python:3.12-slim

# Build and push (one image name everywhere: the Helm chart, deploy/k8s, docs/deploy.md):
#   docker build -t ghcr.io/session-sidecar/session-sidecar:0.1.0 .
#   docker push ghcr.io/session-sidecar/session-sidecar:0.1.0

# Build stage: build the wheel and install it with its dependencies into /opt/sidecar.
# A C compiler builds the fast engine's compiled modules (setup.py); the runtime stage needs none.
FROM ${PYTHON_IMAGE} AS build
# SIDECAR_REQUIRE_COMPILED=1: a failed Cython compile fails the build (setup.py) instead of
# quietly installing the pure-Python modules, which cost several times the CPU per request.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SIDECAR_REQUIRE_COMPILED=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/sidecar \
 && /opt/sidecar/bin/python -m pip install --no-cache-dir /wheels/*.whl \
 && /opt/sidecar/bin/python -m pip uninstall --yes pip

# Runtime stage: the interpreter from the same base image plus the venv, nothing else.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="session-sidecar" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="Session-routing sidecar: adds session-affinity headers in front of LLM inference gateways"
RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin sidecar \
 && mkdir -p /etc/sidecar/tokens
COPY --from=build /opt/sidecar /opt/sidecar
# Bytecode was compiled at install time; the root filesystem may be read-only.
ENV PATH=/opt/sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SIDECAR_LISTEN=0.0.0.0:8080 \
    SIDECAR_ADMIN=0.0.0.0:9091
USER 10001:10001
WORKDIR /
EXPOSE 8080 9091
# Configure with SIDECAR_* variables, or mount a file and set
# SIDECAR_CONFIG=/etc/sidecar/config.yaml. Kubernetes probes use /healthz and /readyz on 9091.
# The admin listener binds 0.0.0.0 so probes and scrapes reach it; the sessions API on it then
# needs bearer tokens: mount a tokens file read-only at /etc/sidecar/tokens/tokens.yaml and set
# SIDECAR_ADMIN_TOKENS_FILE=/etc/sidecar/tokens/tokens.yaml. Without one the sidecar refuses to
# start unless SIDECAR_ADMIN_INSECURE=true (an unauthenticated sessions API; local use only).
ENTRYPOINT ["sidecar"]
CMD ["run"]
