#!/bin/sh
# A docker engine for `make container` and `make container-check` on a box without one running (a CI machine, a
# class box fresh from its installer): `engine.sh start` leaves an engine that already answers as it is (prints
# "found"); otherwise it installs Debian's docker.io when dockerd is missing (as root, as `make browser` installs
# chromium), starts dockerd without touching the host's firewall or bridges (containers then use --network host),
# on overlay2 (vfs, which copies every layer in full, only where overlay2 does not start), and prints "started".
# `engine.sh stop` stops only an engine this script started (its pid file).
set -eu
PIDFILE=/run/kvviz-dockerd.pid
LOG=/var/log/kvviz-dockerd.log

answers() { docker info >/dev/null 2>&1; }

wait_for_engine() {
    tries=0
    while ! answers; do
        tries=$((tries + 1))
        if [ "$tries" -gt 60 ] || ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            return 1
        fi
        sleep 0.5
    done
}

start_with() {
    dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="$1" \
        --pidfile "$PIDFILE.dockerd" >>"$LOG" 2>&1 &
    echo $! >"$PIDFILE"
    wait_for_engine
}

case "${1:-start}" in
start)
    if answers; then
        echo found
        exit 0
    fi
    if ! command -v dockerd >/dev/null 2>&1; then
        if [ "$(id -u)" != 0 ]; then
            echo "engine.sh: no docker engine answers and dockerd is missing: sudo apt-get install docker.io" >&2
            exit 1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    fi
    if ! start_with overlay2; then
        kill "$(cat "$PIDFILE")" 2>/dev/null || true
        sleep 1
        start_with vfs || { echo "engine.sh: dockerd did not start; see $LOG" >&2; exit 1; }
    fi
    echo started
    ;;
stop)
    if [ -f "$PIDFILE" ]; then
        pid="$(cat "$PIDFILE")"
        kill "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
        rm -f "$PIDFILE"
    fi
    ;;
*)
    echo "usage: engine.sh start|stop" >&2
    exit 2
    ;;
esac
