# syntax=docker/dockerfile:1
#
# text-generation-launcher in a container, started as TGI's image is:
#
#   docker build -t tgi-py .                              # CUDA (the default)
#   docker build -t tgi-py:cpu --build-arg DEVICE=cpu .   # CPU only
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data \
#       tgi-py --model-id Qwen/Qwen2.5-0.5B-Instruct
#
# Layers go from the least to the most often changed: system packages, torch,
# the project's dependencies (from pyproject.toml alone), flash-attn (built in
# its own stage), then the project's source. No token is baked in: pass
# HF_TOKEN at run time.

ARG DEVICE=cuda
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04
ARG TORCH_VERSION=2.13.0
# download.pytorch.org index suffix of the CUDA build of torch
ARG TORCH_CUDA=cu128
ARG FLASH_ATTN_VERSION=2.8.3
# Ampere (A100, A10, RTX 30), Ada (L4, L40S, RTX 40), Hopper (H100, H200)
ARG CUDA_ARCHS="8.0;8.6;8.9;9.0"

# ---------------------------------------------------------------- bases
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS base-cuda
FROM ubuntu:${UBUNTU_VERSION} AS base-cpu

# Python and a virtual environment for the runtime (flash-attn builds apart).
FROM base-${DEVICE} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch: the CUDA build, or the CPU build from the CPU index.
FROM python AS torch
ARG DEVICE
ARG TORCH_VERSION
ARG TORCH_CUDA
RUN if [ "$DEVICE" = "cpu" ]; then index=cpu; else index="$TORCH_CUDA"; fi \
    && pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${index}"

# ---------------------------------------------------------------- flash-attn
# flash-attn's setup takes its prebuilt wheel when one matches this torch and
# CUDA, and otherwise compiles for CUDA_ARCHS (set MAX_JOBS to bound memory).
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu${UBUNTU_VERSION} AS flash-attn-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA
ARG FLASH_ATTN_VERSION
ARG CUDA_ARCHS
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
    && pip install packaging psutil ninja wheel setuptools
RUN TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" \
    FLASH_ATTN_CUDA_ARCHS="$(echo "${CUDA_ARCHS}" | tr -d '.')" \
    MAX_JOBS="${MAX_JOBS}" \
    pip wheel --no-build-isolation --no-deps -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"

# The CPU image has no flash-attn: an empty wheel folder.
FROM python AS flash-attn-cpu
RUN mkdir -p /wheels

FROM flash-attn-${DEVICE} AS flash-attn

# ---------------------------------------------------------------- runtime
FROM torch AS runtime
ARG DEVICE
WORKDIR /usr/src/tgi-py

# The project's dependencies, from pyproject.toml alone: this layer is reused
# until the dependencies change, whatever the source does.
COPY pyproject.toml ./
# torch is already installed; the CUDA image also takes the `cuda` extra's
# other packages (triton, for the kernels).
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"])); \
print("\n".join(d for d in p["optional-dependencies"]["cuda"] if not d.startswith("torch")))' \
    > /tmp/requirements.txt \
    && if [ "$DEVICE" = "cpu" ]; then sed -i '/^triton/d' /tmp/requirements.txt; fi \
    && pip install -r /tmp/requirements.txt

COPY --from=flash-attn /wheels /tmp/wheels
# flash-attn's own dependency (einops) comes with it; torch is already there.
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install /tmp/wheels/*.whl; fi \
    && rm -rf /tmp/wheels

COPY proto ./proto
COPY router ./router
COPY server ./server
COPY kernels ./kernels
COPY README.md ./
RUN pip install --no-deps . && rm -rf build

# The CPU image compiles our C++ kernels (tgi_kernels/csrc) for the CPU they
# run on: built here for the build host, and once more, on first use, into the
# same world-writable cache where the serving CPU has other flags.
ENV XDG_CACHE_HOME=/opt/cache
RUN mkdir -p /opt/cache && chmod 1777 /opt/cache \
    && if [ "$DEVICE" = "cpu" ]; then \
        apt-get update && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/* \
        && python3 -c "from tgi_kernels.native import build; print(build())"; \
    fi

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

# The router binds to HOSTNAME (TGI's --hostname env) and PORT: probe the same.
# The start period covers a model download and warmup.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD curl -fsS "http://${HOSTNAME:-127.0.0.1}:${PORT:-80}/health" || exit 1

# The launcher handles SIGTERM as PID 1: it drains requests, stops its shards
# (reaping them) and exits 0.
ENTRYPOINT ["text-generation-launcher"]
CMD ["--json-output"]
