# syntax=docker/dockerfile:1
# vmquota: one image for every service; the container's command selects it (`run watcher|ledger|enforcer|all`,
# `simulate`, ...). Build: `make image` (docker build -t vmquota:dev .).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build stage: build the vmquota wheel and install it with its dependencies into a self-contained venv ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# `vmquota simulate` (the demo cluster of compose.yaml) serves HTTPS with a self-signed certificate, which needs
# cryptography; build with --build-arg SIMULATOR=false for an image without it.
ARG SIMULATOR=true
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/vmquota \
 && /opt/vmquota/bin/pip install /wheels/vmquota-*.whl \
 && if [ "$SIMULATOR" = "true" ]; then /opt/vmquota/bin/pip install "$(ls /wheels/vmquota-*.whl)[sim]"; fi \
 && /opt/vmquota/bin/pip uninstall --yes pip \
 && /opt/vmquota/bin/python -m compileall -q /opt/vmquota

# --- final stage: the same slim base, the venv only; no compiler, no pip, no sources ---------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vmquota" \
      org.opencontainers.image.description="VM-aware, migration-safe ResourceQuotas for KubeVirt" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 vmquota \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vmquota
COPY --from=build /opt/vmquota /opt/vmquota
# State directory for `vmquota simulate --kubeconfig-out` (compose.yaml shares it as a volume); owned by the service
# user so a fresh named volume mounted here is writable.
RUN install -d -o 10001 -g 10001 -m 0750 /var/lib/vmquota
# Read-only root filesystem friendly: bytecode is compiled at build time and never written at run time; the only
# writable path a service may use is /tmp (mount an emptyDir there in Kubernetes).
ENV PATH=/opt/vmquota/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
# health, readiness and Prometheus metrics (/healthz, /readyz, /metrics): --http-port / VMQUOTA_HTTP_PORT
EXPOSE 8080
ENTRYPOINT ["vmquota"]
CMD ["run", "all"]
