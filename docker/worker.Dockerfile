# syntax=docker/dockerfile:1
# plancache GPU worker: claims tuning jobs for this GPU's environment, autotunes, signs, uploads.
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t plancache-worker:0.1.0 .
#
# cuDNN: the worker must run the cuDNN the plans are meant for. torch 2.11.0 pins cuDNN 9.19.0
# (nvidia-cudnn-cu13==9.19.0.56) and the CUDA 13.0.2 libraries; cuDNN 9.19 with frontend 1.32.0 is
# the combination docs/BENCHMARKS.md's H200 figures were measured with. nvidia-cudnn-frontend loads the
# cuDNN of that wheel before any system copy, so the base image is the CUDA 13.0.2 *base* flavour
# (driver hooks and CUDA runtime only): a -cudnn- tag would add a second, different cuDNN
# (13.0.x-cudnn images carry 9.13) and a gigabyte of libraries the wheels already bring.
# Needs a host driver for CUDA 13.0 (>= 580).
FROM nvidia/cuda:13.0.2-base-ubuntu24.04

ARG CUDNN_FRONTEND_VERSION=1.32.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ubuntu's python3 (3.12 on 24.04). Packages are not pinned by version: the archive drops superseded
# versions, so exact pins break rebuilds; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH

COPY docker/requirements-worker.txt /tmp/requirements.txt
# The frontend goes in without its dependencies: those are the optional CuTe-DSL kernel stack
# (nvidia-cutlass-dsl, apache-tvm-ffi; hundreds of MB), which graph plans do not use.
RUN pip install --no-cache-dir --no-deps -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps "nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION}" \
 && rm /tmp/requirements.txt

RUN groupadd --system --gid 10001 plancache \
 && useradd --system --uid 10001 --gid plancache --home-dir /var/lib/plancache --no-create-home --shell /usr/sbin/nologin plancache \
 && install -d -o plancache -g plancache -m 0750 /var/lib/plancache

WORKDIR /app
COPY plancache ./plancache
COPY --chmod=0755 docker/plancache /usr/local/bin/plancache

# PLANCACHE_SERVER_URL, PLANCACHE_TOKEN (worker role) and PLANCACHE_SIGNING_KEY come from the
# deployment (docker/compose.yaml); the spool of finished-but-not-uploaded results lives under
# PLANCACHE_CACHE_DIR, a volume, so a restart uploads what the last run tuned.
ENV PYTHONPATH=/app \
    HOME=/var/lib/plancache \
    PLANCACHE_CACHE_DIR=/var/lib/plancache

USER 10001:10001
VOLUME ["/var/lib/plancache"]

# `worker` reads --server from PLANCACHE_SERVER_URL and --signing-key from PLANCACHE_SIGNING_KEY.
# On SIGTERM it lets a running tuning finish for --shutdown-grace seconds (25), then releases the job.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "plancache", "worker"]
