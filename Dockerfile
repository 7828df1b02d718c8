# syntax=docker/dockerfile:1
#
# text-generation-launcher in a container, started as TGI's image is:
#
#   docker build -t tgi-py .                              # CUDA (the default)
#   docker build -t tgi-py:cpu --build-arg DEVICE=cpu .   # CPU only
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data \
#       tgi-py --model-id Qwen/Qwen2.5-0.5B-Instruct
#
# `make image` builds the CPU image with docker or podman, also where no
# registry is reachable (deploy/image/build.py: a local Debian base and a local
# torch wheel). Layers go from the least to the most often changed: system
# packages, torch, the project's dependencies (from pyproject.toml alone),
# flash-attn (built in its own stage), then the project's source. No token is
# baked in: pass HF_TOKEN at run time.

ARG DEVICE=cuda
# The base images: their defaults are what a machine with a registry pulls.
# The two CUDA images must name the same CUDA and Ubuntu versions (the venv
# built on the first runs flash-attn's build on the second).
ARG CPU_BASE_IMAGE=ubuntu:24.04
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# PyTorch's wheel index; DEVICE=cpu takes its `cpu` suffix, DEVICE=cuda TORCH_CUDA.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl
ARG TORCH_CUDA=cu128
ARG FLASH_ATTN_VERSION=2.8.3
# Ampere (A100, A10, RTX 30), Ada (L4, L40S, RTX 40), Hopper (H100, H200)
ARG CUDA_ARCHS="8.0;8.6;8.9;9.0"

# ---------------------------------------------------------------- bases
FROM ${CUDA_BASE_IMAGE} AS base-cuda
FROM ${CPU_BASE_IMAGE} AS base-cpu
# A folder of torch wheels, empty unless the build names one:
# `--build-context torch-wheels=DIR` (a torch-TORCH_VERSION wheel there is
# installed instead of the index's).
FROM scratch AS torch-wheels
# Certificates that pip trusts while building, none unless the build names a
# folder: `--build-context build-ca=DIR` with DIR/ca.crt (a proxy that
# inspects TLS). Mounted by the RUNs that download, never copied into a layer.
FROM scratch AS build-ca

# Python and a virtual environment, shared by the CPU and CUDA images. g++ and
# the Python headers: torch.compile's C++ and Triton's launchers, and the CPU
# image's own kernels, are compiled where they run.
FROM base-${DEVICE} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates curl \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch: the wheel from torch-wheels where there is one, else the index's
# build for DEVICE. The layer's cache key is the ARGs, not the folder.
FROM python AS torch
ARG DEVICE
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG TORCH_CUDA
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels --mount=type=bind,from=build-ca,target=/tmp/build-ca \
    if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi; \
    py="cp$(python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')" \
    && wheel="$(ls /tmp/torch-wheels/torch-"${TORCH_VERSION}"[+-]*-"$py"-*.whl 2>/dev/null | head -n 1)"; \
    if [ -n "$wheel" ]; then pip install "$wheel"; \
    else \
        if [ "$DEVICE" = "cpu" ]; then index=cpu; else index="$TORCH_CUDA"; fi \
        && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}/${index}"; \
    fi

# ---------------------------------------------------------------- flash-attn
# flash-attn's setup takes its prebuilt wheel when one matches this torch and
# CUDA, and otherwise compiles for CUDA_ARCHS (set MAX_JOBS to bound memory).
FROM ${CUDA_DEVEL_IMAGE} AS flash-attn-cuda
ARG FLASH_ATTN_VERSION
ARG CUDA_ARCHS
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ninja-build \
    && rm -rf /var/lib/apt/lists/*
# The runtime's own venv and torch (same Ubuntu, so the same python3), plus
# what flash-attn's build needs.
COPY --from=torch /opt/venv /opt/venv
RUN --mount=type=bind,from=build-ca,target=/tmp/build-ca \
    if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi; \
    pip install packaging psutil ninja wheel setuptools \
    && TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" \
    FLASH_ATTN_CUDA_ARCHS="$(echo "${CUDA_ARCHS}" | tr -d '.')" \
    MAX_JOBS="${MAX_JOBS}" \
    pip wheel --no-build-isolation --no-deps -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"

# The CPU image has no flash-attn: an empty wheel folder.
FROM python AS flash-attn-cpu
RUN mkdir -p /wheels

FROM flash-attn-${DEVICE} AS flash-attn

# ---------------------------------------------------------------- runtime
# The dependency list, cut from pyproject.toml: the runtime stage copies this
# file alone, so its install layer is reused until the list itself changes
# (not on an edit of the test extra or the tools' settings).
# torch is installed by its own stage; the CUDA image also takes the `cuda`
# extra's other packages (triton, for the kernels).
FROM python AS requirements
ARG DEVICE
COPY pyproject.toml /tmp/
RUN python3 -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"])); \
print("\n".join(d for d in p["optional-dependencies"]["cuda"] if not d.startswith("torch")))' \
    > /tmp/requirements.txt \
    && if [ "$DEVICE" = "cpu" ]; then sed -i '/^triton/d' /tmp/requirements.txt; fi

FROM torch AS runtime
ARG DEVICE
WORKDIR /usr/src/tgi-py

COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN --mount=type=bind,from=build-ca,target=/tmp/build-ca \
    if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi; \
    pip install -r /tmp/requirements.txt

COPY --from=flash-attn /wheels /tmp/wheels
# flash-attn's own dependency (einops) comes with it; torch is already there.
RUN --mount=type=bind,from=build-ca,target=/tmp/build-ca \
    if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi; \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install /tmp/wheels/*.whl; fi \
    && rm -rf /tmp/wheels

# The CPU image compiles our C++ kernels (tgi_kernels/csrc) for the CPU they
# run on: built here for the build host, from the kernels' source alone (a
# minute on two cores, in a layer that an edit elsewhere in the project
# reuses), and once more, on first use, into the same cache (world-writable,
# as any uid may serve) where the serving CPU has other flags. The cache key
# is the sources' content, so the installed package finds this build.
ENV XDG_CACHE_HOME=/opt/cache
COPY kernels ./kernels
RUN mkdir -p /opt/cache/tgi_kernels && chmod 1777 /opt/cache /opt/cache/tgi_kernels \
    && if [ "$DEVICE" = "cpu" ]; then PYTHONPATH=kernels python3 -c "from tgi_kernels.native import build; print(build())"; fi

COPY pyproject.toml ./
COPY proto ./proto
COPY router ./router
COPY server ./server
COPY README.md ./
RUN --mount=type=bind,from=build-ca,target=/tmp/build-ca \
    if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi; \
    pip install --no-deps . && rm -rf build \
    && if [ "$DEVICE" = "cpu" ]; then python3 -c "from tgi_kernels.native import build, cache_root; \
build(); assert len(list(cache_root().iterdir())) == 1, 'the installed kernels compiled again'"; fi

# TGI's conventions: models and the hub cache under /data (a volume), the
# router on port 80, the launcher as the entrypoint (flags as arguments).
# Everything a server writes goes to /data or /tmp, both writable by any
# user, so `docker run --user tgi` (uid 1001, group 0 as on OpenShift) or any
# other uid works as well as root.
ENV HF_HOME=/data \
    PORT=80 \
    TRITON_CACHE_DIR=/tmp/triton \
    PYTHONUNBUFFERED=1
RUN useradd --uid 1001 --gid 0 --create-home --home-dir /home/tgi tgi \
    && chmod g=u /home/tgi \
    && mkdir -p /data && chgrp 0 /data && chmod 1777 /data
VOLUME /data
EXPOSE 80

# The router binds to HOSTNAME (TGI's --hostname env, which the engine sets to
# the container's name) and PORT: probe the same. Podman runs the check
# without HOSTNAME in its environment: the kernel's hostname is the same name.
# The start period covers a model download and warmup.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD curl -fsS "http://${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}:${PORT:-80}/health" || exit 1

# The launcher handles SIGTERM as PID 1: it drains requests, stops its shards
# (reaping them) and exits 0.
ENTRYPOINT ["text-generation-launcher"]
CMD ["--json-output"]
