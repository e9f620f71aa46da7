# The pdserve image: `pdserve` is the entrypoint, so a pod runs e.g. `pdserve @/etc/pdserve/config/decode.args`
# and the operator's pod `pdserve operator --all-namespaces`.
#
#   docker build -t pdserve:0.1.0 .                  # GPU: CUDA runtime base, torch's CUDA build (the default target)
#   docker build -t pdserve:0.1.0-cpu --target cpu . # CPU: slim Python base, torch's CPU build, a C compiler
#   docker build -t pdserve-operator:0.1.0 --target operator .  # the operator alone: no torch, no NIXL
#
# The serving images carry the k8s extra too: the planner's pods run its Kubernetes connector.
#
# Every stage but the GPU one runs on PYTHON_IMAGE, the public Python image or any Debian-like base
# with `python3`, its venv module and apt (scripts/k8s_image.sh builds one from Debian packages,
# where no registry is reachable): pdserve lives in the venv /opt/pdserve, never in the base's
# Python. pip takes its configuration from build args (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL,
# PIP_FIND_LINKS, PIP_CERT) where a machine has its own index or proxy; an empty TORCH_INDEX_URL means pip's
# configured index rather than PyTorch's CPU one.
#
# Layers run from the slowest-changing down: system packages and the venv, torch, the
# dependencies pyproject.toml pins, then pdserve's own wheel, so that an edit to pdserve's source
# rebuilds only the last layers.
#
# Base images are pinned to exact versions; bump them deliberately.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0

# Stage 1: pdserve's wheel, and the requirements each runtime stage installs before it.
FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV VIRTUAL_ENV=/opt/pdserve PATH=/opt/pdserve/bin:$PATH
RUN python3 -m venv /opt/pdserve
WORKDIR /src
COPY pyproject.toml scripts/requirements.py ./
RUN mkdir /requirements \
    && python3 requirements.py k8s > /requirements/cpu.txt \
    && python3 requirements.py kernels k8s > /requirements/cuda.txt
COPY README.md ./
COPY pdserve ./pdserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2a: CPU runtime. The CPU kernels are C compiled for the CPU that runs them, hence gcc;
# they are compiled here too, into PDSERVE_KERNEL_DIR, so that a pod on a node with the build
# machine's CPU loads them instead of compiling about 9 s at every start (its cache is an empty
# volume); any other node compiles its own at first use.
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV VIRTUAL_ENV=/opt/pdserve PATH=/opt/pdserve/bin:$PATH PYTHONUNBUFFERED=1 PDSERVE_KERNEL_DIR=/opt/pdserve/cpu_kernels
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY --from=build /requirements/cpu.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels \
    && python3 -c "from pdserve.kernels.cpu.build import prebuild; from pathlib import Path; prebuild(Path('$PDSERVE_KERNEL_DIR'))" \
    && chmod -R a+rX "$PDSERVE_KERNEL_DIR"
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# Stage 2b: the operator (`pdserve operator`), a few hundred MB lighter than a serving image:
# only what the operator imports (the registry's etcd client, gRPC and protobuf under it,
# metrics) and the k8s extra, each as pyproject.toml pins it (tests/test_dockerfile.py holds the
# two to each other and to what the operator imports), then pdserve without its dependencies.
FROM ${PYTHON_IMAGE} AS operator
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV VIRTUAL_ENV=/opt/pdserve PATH=/opt/pdserve/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/pdserve \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
RUN pip install --no-cache-dir "msgspec>=0.18" "aetcd>=1.0" "grpcio>=1.60" "protobuf>=5" \
        "prometheus-client>=0.20" "kopf>=1.37" "kubernetes>=37"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["operator", "--all-namespaces"]

# Stage 2c: GPU runtime (the default target): torch's CUDA build and Triton from PyPI. Ubuntu 24.04
# images ship a user `ubuntu` with uid 1000, removed so that pdserve's user takes that uid; Triton
# compiles its launcher against Python.h, hence python3-dev.
FROM ${CUDA_IMAGE} AS cuda
ARG TORCH_VERSION
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV VIRTUAL_ENV=/opt/pdserve PATH=/opt/pdserve/bin:$PATH PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin pdserve
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=build /requirements/cuda.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]
