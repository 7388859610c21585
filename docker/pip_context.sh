#!/bin/sh
# Fill docker/pip/ (never committed; only the Dockerfile's build stage copies it) with what pip needs to build the
# image as it installs on this box:
#   ca.crt     the CA bundle pip uses here (pip's `cert` setting, else PIP_CERT), when set: a box that reaches the
#              package index through its own certificate authority
#   wheels/    for the Debian base (`cpu` as the first argument): the torch requirements.txt pins, as pip on this box
#              resolves it (a local CPU wheel where its find-links hold one); the CUDA base takes torch from the index
# Usage: docker/pip_context.sh cpu|cuda PYTHON
set -eu
cd "$(dirname "$0")/.."
KIND="${1:-cuda}"
PYTHON="${2:-python3}"
OUT=docker/pip
find "$OUT" -mindepth 1 ! -name README.md -exec rm -rf {} +
mkdir -p "$OUT/wheels"
CERT="$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)"
CERT="${CERT:-${PIP_CERT:-}}"
if [ -n "$CERT" ] && [ -f "$CERT" ]; then
    cp "$CERT" "$OUT/ca.crt"
fi
if [ "$KIND" = cpu ]; then
    TORCH="$(grep -E '^torch==' requirements.txt)"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: --dest "$OUT/wheels" "$TORCH"
fi
ls "$OUT/wheels"
