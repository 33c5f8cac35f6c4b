# syntax=docker/dockerfile:1
# Images of the fleet, one target each (compose.yaml, deploy/kubernetes/):
#   docker build --target gateway     -t tokenfleet-gateway .     # HTTP gateway and metrics-exporter, no torch
#   docker build --target worker-cpu  -t tokenfleet-worker-cpu .  # CPU torch
#   docker build --target worker-cuda -t tokenfleet-worker-cuda . # NVIDIA CUDA torch
#   docker build --target flower      -t tokenfleet-flower .      # Celery's monitor
# Each installs its dependencies from pyproject.toml alone, in a layer of its
# own, before the source is copied: a code change rebuilds the last two layers,
# never torch. The entry point is `tokenfleet`; models come from the volume at
# /models (docs/deploy.md, "Models").

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- the source, copied into each target after its dependencies --
FROM scratch AS source
COPY pyproject.toml README.md /app/
COPY shared /app/shared
COPY producer /app/producer
COPY workers /app/workers

# -- what every Python image shares: the user, the venv, the requirement lister --
FROM ${PYTHON_IMAGE} AS python-base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
    && useradd --create-home --uid 10001 tokenfleet
WORKDIR /app
COPY deploy/docker/requirements.py /opt/requirements.py

# -- the HTTP gateway and `tokenfleet metrics-exporter` (deploy/kubernetes/components/
# metrics-exporter): the client, FastAPI, uvicorn, prometheus-client, boto3 (a files store
# on S3); no torch, no Celery --
FROM python-base AS gateway
COPY pyproject.toml ./
RUN python /opt/requirements.py pyproject.toml gateway exporter s3 > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=source /app ./
RUN pip install --no-cache-dir --no-deps . && rm -rf build
# The default TOKENFLEET_FILES_URL (file:///var/lib/tokenfleet/files): a volume the
# gateway's user writes, shared by the gateways of a host (or set s3://bucket/prefix).
RUN mkdir -p /var/lib/tokenfleet/files && chown 10001:10001 /var/lib/tokenfleet/files
VOLUME ["/var/lib/tokenfleet/files"]
USER 10001:10001
EXPOSE 8000
# urllib, not curl: the slim image has no curl. /healthz: the process serves.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["tokenfleet"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]

# -- Flower, Celery's monitor of the workers (the Celery app imports no torch) --
FROM python-base AS flower
COPY pyproject.toml ./
RUN python /opt/requirements.py pyproject.toml flower > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=source /app ./
RUN pip install --no-cache-dir --no-deps . && rm -rf build
USER 10001:10001
EXPOSE 5555
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5555/healthcheck', timeout=2)"]
ENTRYPOINT ["celery", "-A", "tokenfleet.workers.app"]
CMD ["flower", "--port=5555"]

# -- a CPU worker: torch from PyTorch's CPU index first, in a layer of its own,
# so that the worker extra finds it satisfied and never pulls a CUDA build --
FROM python-base AS worker-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
RUN python /opt/requirements.py pyproject.toml worker structured > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=source /app ./
RUN pip install --no-cache-dir --no-deps . && rm -rf build \
    && mkdir -p /models && chown 10001:10001 /models
# Models live on a volume, not in the image: Hugging Face Hub downloads
# (hf:ORG/NAME) in HF_HOME, the built-in synthetic models in XDG_CACHE_HOME,
# your own model directories anywhere under /models (--model /models/NAME).
ENV HF_HOME=/models/huggingface XDG_CACHE_HOME=/models/cache
VOLUME ["/models"]
USER 10001:10001
EXPOSE 9100
# /healthz on the metrics port: the process lives and its engine thread steps.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz', timeout=2)"]
ENTRYPOINT ["tokenfleet"]
CMD ["worker", "--gpus", "none", "--metrics-port", "9100"]

# -- a CUDA worker: NVIDIA's runtime image, Python from Ubuntu, torch from
# PyTorch's index for the CUDA version the base image carries. Its steps repeat
# the CPU worker's on another base: a stage cannot be reused across bases
# (tests/test_dockerfile.py checks that both keep the same order) --
FROM ${CUDA_IMAGE} AS worker-cuda
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 tokenfleet
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY deploy/docker/requirements.py /opt/requirements.py
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
RUN python /opt/requirements.py pyproject.toml worker structured > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=source /app ./
RUN pip install --no-cache-dir --no-deps . && rm -rf build \
    && mkdir -p /models && chown 10001:10001 /models
ENV HF_HOME=/models/huggingface XDG_CACHE_HOME=/models/cache
VOLUME ["/models"]
USER 10001:10001
EXPOSE 9100
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz', timeout=2)"]
ENTRYPOINT ["tokenfleet"]
CMD ["worker", "--gpus", "all", "--metrics-port", "9100"]
