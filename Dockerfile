# One image for workers, the gateway and Flower (see compose.yaml).
# CPU by default; on NVIDIA hosts build FROM a CUDA runtime image and install the
# torch build for that CUDA instead of the CPU one.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY workers ./workers
RUN pip install --no-cache-dir "torch==2.13.0" && pip install --no-cache-dir ".[gateway]" flower
ENV TOKENFLEET_REDIS_URL=redis://redis:6379/0
CMD ["tokenfleet", "worker", "--gpus", "none"]
