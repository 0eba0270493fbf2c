#!/usr/bin/env bash
# Install the task-image toolchain (Debian packages): buildah (the daemonless builder of the
# local provider, with runc and the CNI plugins for RUN steps' private network), skopeo (registry
# lookups), mmdebstrap (Debian bases from the Debian archive: `miles-env images bootstrap`),
# eatmydata (faster bootstrap) and docker-registry (the loopback registry serving them); and
# ubuntu-keyring, the keys that sign the Ubuntu archive, for the Ubuntu bases (Debian packages it
# from trixie on; on an older host, apt downloads trixie's package, verified by the host's Debian
# keyring as any apt download is).
# Idempotent: installs only what is missing; exit 0 when every tool is on PATH.
set -euo pipefail
need=()
for pair in buildah:buildah skopeo:skopeo mmdebstrap:mmdebstrap eatmydata:eatmydata docker-registry:docker-registry runc:runc; do
    tool=${pair%%:*} pkg=${pair#*:}
    command -v "$tool" >/dev/null 2>&1 || need+=("$pkg")
done
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg
[ ${#need[@]} -eq 0 ] && [ -s $keyring ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "[install-images] missing: ${need[*]}; only root can apt-get install them" >&2
    exit 2
fi
echo "[install-images] installing ${need[*]} ubuntu-keyring (Debian)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
[ ${#need[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
keyring_from_trixie() {
    local tmp opts
    tmp=$(mktemp -d) && mkdir -p "$tmp/lists/partial" && chmod -R a+rwx "$tmp"
    echo "deb ${MILES_ENV_DEBIAN_MIRROR:-http://deb.debian.org/debian} trixie main" >"$tmp/sources.list"
    opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$tmp/lists")
    apt-get -qq "${opts[@]}" update >/dev/null && (cd "$tmp" && apt-get -qq "${opts[@]}" download ubuntu-keyring >/dev/null) \
        && dpkg -i "$tmp"/ubuntu-keyring_*.deb >/dev/null
    rm -rf "$tmp"
}
if [ ! -s $keyring ]; then
    if apt-cache policy ubuntu-keyring 2>/dev/null | grep -q "Candidate: [0-9]"; then
        apt-get install -y -qq --no-install-recommends ubuntu-keyring >/dev/null || true
    else
        keyring_from_trixie || true
    fi
    [ -s $keyring ] || echo "[install-images] ubuntu-keyring did not install: the Ubuntu bases will be skipped" >&2
fi
for tool in buildah skopeo mmdebstrap docker-registry; do
    command -v "$tool" >/dev/null 2>&1 || { echo "[install-images] $tool still missing" >&2; exit 3; }
done
