#!/usr/bin/env bash
# Make sure the Debian packages that tests and benchmarks use are on this machine: redis-server
# (the integration tests start their own servers on free 127.0.0.1 ports; the LMCache lm:// server
# comes with the Python install) and libtcmalloc-minimal4 (the allocator vLLM's CPU guide asks
# for; the vLLM benchmarks preload it), and g++ (builds kmesh_blend/cpu's kernel). Idempotent and
# quiet: does nothing when all are present.
set -euo pipefail

have_tcmalloc() {
    ldconfig -p 2>/dev/null | grep -q "libtcmalloc_minimal.so.4"
}
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
have_tcmalloc || missing+=(libtcmalloc-minimal4)
command -v c++ >/dev/null 2>&1 || missing+=(g++)  # builds the CPU cascade-decode kernel
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "services: ${missing[*]} missing and apt-get unavailable; install by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "services: installing ${missing[*]} (apt)"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
# Debian may start a system instance on :6379; the tests use their own ports, so it is harmless.
command -v redis-server >/dev/null
have_tcmalloc
echo "services: redis-server $(redis-server --version | awk '{print $3}'), libtcmalloc_minimal.so.4"
