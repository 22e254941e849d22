# specserve on the Ray image of the pinned Ray version (pyproject.toml: ray[serve]==2.60.0).
#
#   CPU:   docker build -t specserve:0.1.0-cpu .
#          docker build -t specserve:0.1.0-cpu-family --build-arg BUILD_FAMILY=true .   # + embedded family
#   CUDA:  docker build -t specserve:0.1.0-cu128 --build-arg ACCELERATOR=cu128 .
#
# ACCELERATOR names both the Ray image's platform tag (rayproject/ray:2.60.0-py311-<ACCELERATOR>) and
# PyTorch's wheel index (https://download.pytorch.org/whl/<ACCELERATOR>), so the CPU image gets the CPU
# torch wheel and a CUDA image the torch wheel built for its CUDA: pick a cuXYZ that both publish for
# these versions. The image runs as the Ray image's non-root user `ray` (uid 1000, gid 100); KubeRay
# starts `ray start` in it, so there is no ENTRYPOINT of ours. See docs/operator-guide.md, "Kubernetes (KubeRay)".
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG ACCELERATOR=cpu
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${ACCELERATOR}

ARG ACCELERATOR
ARG TORCH_VERSION=2.13.0
ARG BUILD_FAMILY=false

# Serve's gRPC proxy refuses messages over 8 MiB in its transport, before they are read; the guarded
# deserializers (protos/guard.py) answer INVALID_ARGUMENT up to that size. SPECSERVE_CACHE: the family.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=8388608 \
    SPECSERVE_CACHE=/home/ray/.cache/specserve

# /app belongs to `ray`: setuptools writes its build files there.
USER 0
RUN mkdir -p /app && chown 1000:100 /app
USER 1000
WORKDIR /app

# torch first, from PyTorch's index for this accelerator; `pip install .` below then keeps it (it
# satisfies the torch==TORCH_VERSION pin) and takes every other pinned dependency from PyPI.
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${ACCELERATOR}" \
        "torch==${TORCH_VERSION}"

COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 protos ./protos
COPY --chown=1000:100 actors ./actors
COPY --chown=1000:100 cluster ./cluster
COPY --chown=1000:100 configs ./configs

# Install the project with the serving set of pinned dependencies only (pyproject.toml's `dependencies`: no
# extras, so no locust, matplotlib, sacrebleu or grpcio-tools), non-editable: Ray workers import cluster,
# actors and protos from site-packages whatever their working directory. The gRPC modules are the committed
# ones (generated with the pinned grpcio-tools; a test checks they are current). Last, check from
# site-packages (-P: not from /app) that what Serve imports (serveConfigV2's import_path,
# grpc_servicer_functions) imports.
RUN pip install --no-cache-dir . \
    && python -P -c "import cluster.serving.fronts.app, protos.guard, protos.specserve_pb2_grpc"

# Optional: train the embedded model family (seeded: every pod of this image gets the same models) and
# build its Max-Gram bigram table into $SPECSERVE_CACHE, so configs/k8s-cpu.yaml serves without a volume.
# Takes ~10 min on 2 quiet cores. The last command also generates 8 tokens through it as a smoke test.
RUN if [ "${BUILD_FAMILY}" = "true" ]; then \
        specserve zoo build \
        && specserve generate --config configs/k8s-cpu.yaml --prompt "import os" --max-new-tokens 8; \
    fi

EXPOSE 8000 9000 8080
