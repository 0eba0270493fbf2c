#!/usr/bin/env bash
# The Debian packages the test suite uses, in ONE apt transaction (one `apt-get update`, one
# dpkg run) instead of one per install script: docker.io (the docker sandbox), tmux (Harbor's
# terminus-2), chromium + fonts (the viewer's browser tests), redis-server (the Redis queue's
# tests start their own), nodejs + npm (the agent CLIs), buildah, skopeo, mmdebstrap, eatmydata,
# docker-registry and runc (task images: install-images.sh), slirp4netns (the network of a local
# sandbox whose task asks for one: sandboxes/local/network.py). Each install-*.sh still installs its own
# package when run alone; this only batches them. Idempotent: installs only what is missing;
# without root it installs nothing and the per-script checks say what is missing.
set -euo pipefail
want=()
need() { command -v "$1" >/dev/null 2>&1 || want+=("${@:2}"); }
need dockerd docker.io
need tmux tmux
need chromium chromium fonts-dejavu-core
need node nodejs
need npm npm
bare=()  # installed without recommends, as install-redis.sh does
command -v redis-server >/dev/null 2>&1 || bare+=(redis-server)
# The task-image tools (install-images.sh says what each is for).
for tool in buildah skopeo mmdebstrap eatmydata docker-registry runc; do
    command -v "$tool" >/dev/null 2>&1 || bare+=("$tool")
done
[ -x /usr/lib/cni/bridge ] || bare+=(containernetworking-plugins)  # buildah RUN steps' private network
command -v slirp4netns >/dev/null 2>&1 || bare+=(slirp4netns)  # local sandboxes with network 'public'
[ ${#want[@]} -eq 0 ] && [ ${#bare[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system: missing ${want[*]} ${bare[*]} and only root can apt-get install them" >&2
    exit 0
fi
echo "install-system: apt-get install ${want[*]} ${bare[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
[ ${#want[@]} -eq 0 ] || apt-get install -y -qq "${want[@]}" >/dev/null
[ ${#bare[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${bare[@]}" >/dev/null
# redis-server's package starts the system service where systemd runs; the tests want only the binary.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
