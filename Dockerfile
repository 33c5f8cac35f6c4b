# One image for workers, the gateway and Flower (see compose.yaml).
# CPU by default: torch comes from PyTorch's CPU index first, so that installing
# the worker extra finds it satisfied and never pulls a CUDA build. On NVIDIA
# hosts build FROM a CUDA runtime image and take torch from the index of that
# CUDA version instead (https://pytorch.org/get-started/locally/).
FROM python:3.11-slim
WORKDIR /app
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY workers ./workers
RUN pip install --no-cache-dir ".[worker,gateway]" flower
# Not root: Celery warns at every start of a worker run with superuser privileges,
# and a worker needs none (it writes only its home's cache: built-in models).
RUN useradd --create-home tokenfleet
USER tokenfleet
CMD ["tokenfleet", "worker", "--gpus", "none"]
