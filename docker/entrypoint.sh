#!/bin/sh
# Container entry point: check the settings first (a typo in KVVIZ_* fails loudly, before students connect),
# warm the result store (every page's default run and every lesson step, stored in the models volume; KVVIZ_WARM=0
# skips it), then serve the app. KVVIZ_ENTRYPOINT_DRY_RUN=1 prints the commands instead of running them (tests).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m kvviz config >/dev/null
if [ "${KVVIZ_WARM:-1}" = 1 ]; then
    if [ "${KVVIZ_ENTRYPOINT_DRY_RUN:-0}" = 1 ]; then
        echo "$PYTHON -m kvviz_app.warm"
    else
        "$PYTHON" -m kvviz_app.warm || echo "warm-up: some runs failed (listed above); serving anyway" >&2
    fi
fi
set -- "$PYTHON" -m streamlit run app.py \
    --server.port "${PORT:-8501}" --server.address "${KVVIZ_ADDRESS:-0.0.0.0}" \
    --server.maxUploadSize "${KVVIZ_MAX_UPLOAD_MB:-2}" "$@"
if [ "${KVVIZ_ENTRYPOINT_DRY_RUN:-0}" = 1 ]; then
    echo "$*"
    exit 0
fi
exec "$@"
