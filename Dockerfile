# kvviz for a class: pinned requirements, the default model baked in, a non-root user, a healthcheck.
# One file, two bases (every line below the ARG is shared, so what is checked on one base is what the other builds):
#   the CUDA runtime (default: the GPU classroom)   docker compose up -d      (or: make container)
#   a local Debian base, for a box without a registry or a GPU:   make container CONTAINER_BASE=debian
# Hub models to bake in: --build-arg HUB_MODELS="Qwen/Qwen2.5-0.5B-Instruct,..." (docs/deployment.md).
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# The system both stages share: Python, curl for the healthcheck, the kvviz user, the models folder.
FROM ${BASE} AS system
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvviz \
    PATH=/opt/kvviz/bin:$PATH \
    KVVIZ_CACHE=/models/kvviz \
    HF_HOME=/models/huggingface
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --create-home --uid 10001 kvviz \
    && mkdir -p /models && chown kvviz:kvviz /models

# The build stage: the venv alone, so that a change to the sources leaves it (and the final image's copy of it)
# cached. docker/pip/ (made by `make container`, never committed) may hold a CA bundle pip needs to reach the package
# index from this box and wheels pip prefers to the index's (a CPU torch); the final image inherits neither.
FROM system AS build
WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
COPY docker/pip/ /tmp/pip/
RUN python3 -m venv /opt/kvviz \
    && if [ -f /tmp/pip/ca.crt ]; then export PIP_CERT=/tmp/pip/ca.crt; fi \
    && mkdir -p /tmp/pip/wheels \
    && pip install --find-links /tmp/pip/wheels -r requirements.txt \
    && pip install --no-deps -r requirements-nodeps.txt

# The sources, without docker/pip/.
FROM system AS sources
COPY . /app
RUN rm -rf /app/docker/pip

FROM system
COPY --from=build /opt/kvviz /opt/kvviz
COPY --from=sources --chown=10001:10001 /app /app
WORKDIR /app
USER 10001
# Bake the models so class runs need no network: the embedded default, converted once, plus any hub ids asked for.
ARG HUB_MODELS=""
RUN python -m kvviz prepare --hub-models "$HUB_MODELS"
ENV HF_HUB_OFFLINE=1

EXPOSE 8501
# Every 10 s, so a server that is up is reported healthy within seconds; the start period covers the warm-up.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["sh", "-c", "curl --fail --silent --max-time 4 http://localhost:${PORT:-8501}/_stcore/health"]
ENTRYPOINT ["/app/docker/entrypoint.sh"]
