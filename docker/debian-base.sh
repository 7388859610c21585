#!/bin/sh
# The local base image for a box that reaches no image registry (and has no GPU): Debian bookworm made with
# debootstrap from the Debian mirror apt already uses, imported as an image once; later builds reuse it.
#   docker/debian-base.sh [IMAGE]          (make container CONTAINER_BASE=debian runs it)
# Bookworm's python3 is 3.11, which CPU torch wheels for cp311 fit.
set -eu
IMAGE="${1:-kvviz-base:bookworm}"
# An imported root file system has no environment: give it the PATH Debian images have.
SYSTEM_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE: present, reused"
    exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "debian-base.sh: debootstrap is missing: sudo apt-get install debootstrap" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
ROOTFS="$(mktemp -d)"
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,curl,ca-certificates bookworm "$ROOTFS" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import --change "ENV PATH=$SYSTEM_PATH" - "$IMAGE" >/dev/null
echo "$IMAGE: made with debootstrap"
