# kvviz for a classroom GPU box: CUDA runtime base, pinned requirements, models baked in, non-root user.
#   docker build -t kvviz --build-arg HUB_MODELS="Qwen/Qwen2.5-0.5B-Instruct" .
#   docker run --gpus all -p 8501:8501 kvviz
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG HUB_MODELS=""
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvviz \
    PATH=/opt/kvviz/bin:$PATH \
    KVVIZ_CACHE=/models/kvviz \
    HF_HOME=/models/huggingface

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kvviz \
    && useradd --create-home --uid 10001 kvviz \
    && mkdir -p /models && chown kvviz:kvviz /models

WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
RUN pip install -r requirements.txt \
    && pip install --no-deps -r requirements-nodeps.txt

COPY --chown=kvviz:kvviz . .
USER 10001
# Bake the models so class runs need no network: the embedded default, converted once, plus any hub ids asked for.
RUN python -m kvviz prepare --hub-models "$HUB_MODELS"
ENV HF_HUB_OFFLINE=1

EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "--fail", "--silent", "http://localhost:8501/_stcore/health"]
ENTRYPOINT ["/app/docker/entrypoint.sh"]
