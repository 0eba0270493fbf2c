#!/usr/bin/env bash
# Install Debian's redis-server (the Redis replay queue's tests and benchmark start their own
# instance from this binary, on a free port with AOF on; the system service is never used).
# Idempotent: does nothing when redis-server is already on PATH. Installing needs root.
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-redis: redis-server is missing and only root can apt-get install it" >&2
    exit 2
fi
echo "install-redis: installing Debian's redis-server"
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) >/dev/null
# The package starts the system service where systemd runs; we want only the binary.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
command -v redis-server >/dev/null 2>&1 || { echo "install-redis: redis-server still not on PATH" >&2; exit 2; }
