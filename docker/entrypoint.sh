#!/bin/sh
# Container entry point: check the settings first (a typo in KVVIZ_* fails loudly, before students connect),
# then serve the app. KVVIZ_ENTRYPOINT_DRY_RUN=1 prints the server command instead of running it (used by tests).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m kvviz config >/dev/null
set -- "$PYTHON" -m streamlit run app.py \
    --server.port "${PORT:-8501}" --server.address "${KVVIZ_ADDRESS:-0.0.0.0}" \
    --server.maxUploadSize "${KVVIZ_MAX_UPLOAD_MB:-2}" "$@"
if [ "${KVVIZ_ENTRYPOINT_DRY_RUN:-0}" = 1 ]; then
    echo "$@"
    exit 0
fi
exec "$@"
