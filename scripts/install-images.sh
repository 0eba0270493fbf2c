#!/usr/bin/env bash
# Install the task-image toolchain (Debian packages): buildah (the daemonless builder of the
# local provider, with runc and the CNI plugins for RUN steps' private network), skopeo (registry
# lookups), mmdebstrap (Debian bases from the Debian archive: `miles-env images bootstrap`),
# eatmydata (faster bootstrap) and docker-registry (the loopback registry serving them).
# Idempotent: installs only what is missing; exit 0 when every tool is on PATH.
set -euo pipefail
need=()
for pair in buildah:buildah skopeo:skopeo mmdebstrap:mmdebstrap eatmydata:eatmydata docker-registry:docker-registry runc:runc; do
    tool=${pair%%:*} pkg=${pair#*:}
    command -v "$tool" >/dev/null 2>&1 || need+=("$pkg")
done
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "[install-images] missing: ${need[*]}; only root can apt-get install them" >&2
    exit 2
fi
echo "[install-images] installing ${need[*]} (Debian)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
for tool in buildah skopeo mmdebstrap docker-registry; do
    command -v "$tool" >/dev/null 2>&1 || { echo "[install-images] $tool still missing" >&2; exit 3; }
done
