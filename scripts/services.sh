#!/usr/bin/env bash
# Make sure the storage services the integration tests start are installable on this machine:
# Debian's redis-server (the LMCache lm:// server comes with the Python install). Idempotent and
# quiet: does nothing when redis-server is already on PATH. The tests start and stop their own
# servers on free 127.0.0.1 ports; nothing is left running.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "services: redis-server missing and apt-get unavailable; install redis-server by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "services: installing redis-server (apt)"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
# Debian may start a system instance on :6379; the tests use their own ports, so it is harmless.
command -v redis-server >/dev/null
echo "services: redis-server $(redis-server --version | awk '{print $3}')"
