# syntax=docker/dockerfile:1
# hloserve's container image. No model is baked in: the repository is mounted at /mnt/models,
# where KServe's storage initializer puts it.
#
#   docker build -t hloserve:cpu .                                # CPU
#   docker build --build-arg VARIANT=cuda12 -t hloserve:cuda12 .  # NVIDIA GPUs (or cuda13)
#
# JAX's CUDA wheels carry the CUDA libraries; the node's NVIDIA driver (the container toolkit)
# is all the GPU variant needs from the host. The default command is `hloserve serve`;
# `hloserve node` (several GPUs in one pod) is the same image with the command `node`.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS wheels
ARG VARIANT=cpu
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src src
COPY actors actors
COPY examples/repository examples/repository
RUN extra=$([ "$VARIANT" = cpu ] || echo "[$VARIANT]") \
 && pip wheel --no-cache-dir --wheel-dir /wheels ".$extra"

FROM python:${PYTHON}-slim
ARG VARIANT=cpu
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    extra=$([ "$VARIANT" = cpu ] || echo "[$VARIANT]") \
 && pip install --no-cache-dir --no-index --find-links /wheels "hloserve$extra" \
 && useradd --uid 1000 --user-group --create-home hloserve
USER 1000
ENV HLOSERVE_SERVER_MODEL_REPOSITORY=/mnt/models \
    HLOSERVE_SERVER_HOST=0.0.0.0 \
    HLOSERVE_SERVER_EXECUTABLE_CACHE=/home/hloserve/.cache/hloserve/executables \
    PYTHONUNBUFFERED=1
WORKDIR /home/hloserve
EXPOSE 8000 8001 8002
ENTRYPOINT ["hloserve"]
CMD ["serve"]
