# syntax=docker/dockerfile:1
# vmquota: one image for every service; the container's command selects it (`run watcher|ledger|enforcer|all`,
# `status`, `replay`, ...). Two targets:
#   product   (the default, the last stage): the services and the operator commands, without the development tools
#             (services/devtools: the simulated cluster, the demo, the embedded nats-server). Build: `make image`.
#   devtools  the same plus the development tools and the `sim` extra (cryptography, cel-python): `vmquota simulate`,
#             `vmquota demo`, `vmquota up`. compose.yaml builds it for its simulated cluster.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- the wheel -----------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# --- one self-contained venv per target, each at /opt/vmquota (a venv's scripts name their own path) -----------------
FROM ${PYTHON_IMAGE} AS venv-product
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/vmquota \
 && /opt/vmquota/bin/pip install /wheels/vmquota-*.whl \
 && rm -rf "$(/opt/vmquota/bin/python -c 'import pathlib, services; print(pathlib.Path(services.__file__).parent)')/devtools" \
 && /opt/vmquota/bin/pip uninstall --yes pip \
 && /opt/vmquota/bin/python -m compileall -q /opt/vmquota

FROM ${PYTHON_IMAGE} AS venv-devtools
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/vmquota \
 && /opt/vmquota/bin/pip install "$(ls /wheels/vmquota-*.whl)[sim]" \
 && /opt/vmquota/bin/pip uninstall --yes pip \
 && /opt/vmquota/bin/python -m compileall -q /opt/vmquota

# --- the base of both targets: the same slim base, a venv only; no compiler, no pip, no sources -----------------------
FROM ${PYTHON_IMAGE} AS base
LABEL org.opencontainers.image.title="vmquota" \
      org.opencontainers.image.description="VM-aware, migration-safe ResourceQuotas for KubeVirt" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 vmquota \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vmquota
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

# --- devtools: the simulated cluster, the demo and `vmquota up` as well (compose.yaml's simcluster) ---------------------
FROM base AS devtools
COPY --from=venv-devtools /opt/vmquota /opt/vmquota

# --- product (the default target): what runs in a cluster ---------------------------------------------------------------
FROM base AS product
COPY --from=venv-product /opt/vmquota /opt/vmquota
