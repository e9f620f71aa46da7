# The pdserve image: `pdserve` is the entrypoint, so a pod runs e.g. `pdserve @/etc/pdserve/config/decode.args`
# and the operator's pod `pdserve operator --all-namespaces`.
#
#   docker build -t pdserve:0.1.0 .                  # GPU: CUDA runtime base, torch's CUDA build (the default target)
#   docker build -t pdserve:0.1.0-cpu --target cpu . # CPU: slim Python base, torch's CPU build, a C compiler
#   docker build -t pdserve-operator:0.1.0 --target operator .  # the operator alone: no torch, no NIXL
#
# The serving images carry the k8s extra too: the planner's pods run its Kubernetes connector.
#
# Base images are pinned to exact versions; bump them deliberately.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0

# Stage 1: pdserve's wheel (its dependencies are installed in the runtime stages).
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2a: CPU runtime. The CPU kernels are compiled at first use, hence gcc.
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python -m pip install --no-cache-dir "$(ls /wheels/*.whl)[k8s]" \
    && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# Stage 2b: the operator (`pdserve operator`), a few hundred MB lighter than a serving image:
# pdserve without its dependencies, then only what the operator imports (the registry's etcd
# client, gRPC and protobuf under it, metrics) and the k8s extra, each as pyproject.toml pins it
# (tests/test_dockerfile.py holds the two to each other and to what the operator imports).
FROM ${PYTHON_IMAGE} AS operator
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -m pip install --no-cache-dir "msgspec>=0.18" "aetcd>=1.0" "grpcio>=1.60" "protobuf>=5" \
        "prometheus-client>=0.20" "kopf>=1.37" "kubernetes>=37" \
    && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["operator", "--all-namespaces"]

# Stage 2c: GPU runtime (the default target): torch's CUDA build and Triton from PyPI. Ubuntu 24.04
# images ship a user `ubuntu` with uid 1000, removed so that pdserve's user takes that uid; Triton
# compiles its launcher against Python.h, hence python3-dev.
FROM ${CUDA_IMAGE} AS cuda
ARG TORCH_VERSION
ENV VIRTUAL_ENV=/opt/pdserve PATH=/opt/pdserve/bin:$PATH PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "$(ls /wheels/*.whl)[kernels,k8s]" \
    && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]
