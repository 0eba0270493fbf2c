#!/usr/bin/env bash
# Start a Docker engine for the docker sandbox provider and build the local test image.
#
# Idempotent: installs Debian's docker.io only when dockerd is missing, starts
# dockerd only when the socket does not answer, imports the image only when it
# is absent. No registry pulls: the image `miles-env/hostroot:latest` is made
# with `docker import` from the host's own binaries (shell tools of a few Debian
# packages, python3 and its stdlib, the shared libraries they load): ~60 MB. Exit 0 when `docker info` answers and the image
# exists; non-zero with the reason on stderr otherwise.
#
# Env: MILES_DOCKER_IMAGE (image name), MILES_DOCKERD_LOG (daemon log path),
#      MILES_DOCKERD_STORAGE (overlay2 first, then vfs).
set -euo pipefail

IMAGE="${MILES_DOCKER_IMAGE:-miles-env/hostroot:latest}"
LOG="${MILES_DOCKERD_LOG:-/tmp/miles-env-dockerd.log}"
SOCK=/var/run/docker.sock

say() { echo "[start-dockerd] $*" >&2; }

if ! command -v dockerd >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then say "dockerd missing and not root: cannot install docker.io"; exit 2; fi
    say "installing docker.io (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq docker.io >/dev/null
fi

answers() { timeout 5 docker -H "unix://$SOCK" info >/dev/null 2>&1; }

# A daemon started by an older script from a temp dir since removed answers `docker info` but fails
# every exec (runc's process files live in its TMPDIR): restart it.
for pid in $(pidof dockerd 2>/dev/null); do
    tmp=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^TMPDIR=//p')
    if [ -n "$tmp" ] && [ ! -d "$tmp" ]; then
        say "dockerd (pid $pid) runs with TMPDIR=$tmp, which is gone (every exec would fail): restarting it"
        kill "$pid"; for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
done

if ! answers; then
    for driver in ${MILES_DOCKERD_STORAGE:-overlay2 vfs}; do
        say "starting dockerd (storage driver $driver), log $LOG"
        # setsid + nohup: the daemon outlives this script and the caller's session. Without the
        # caller's TMPDIR: runc keeps each exec's process file there, so a daemon started from a
        # test's (or a CI run's) private temp dir fails every exec once that dir is removed
        # ("OCI runtime exec failed: open $TMPDIR/runc-process...: no such file or directory").
        setsid nohup env -u TMPDIR dockerd --iptables=false --ip6tables=false --bridge=none \
            --storage-driver="$driver" >"$LOG" 2>&1 </dev/null &
        for _ in $(seq 60); do
            answers && break
            kill -0 $! 2>/dev/null || break
            sleep 0.5
        done
        answers && break
        kill $! 2>/dev/null || true
        wait $! 2>/dev/null || true
        say "dockerd with $driver did not come up: $(tail -n 3 "$LOG" | tr '\n' ' ')"
    done
fi
answers || { say "no Docker engine answers on $SOCK"; exit 3; }

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    say "importing $IMAGE from the host's own binaries (no registry)"
    # A small rootfs: the shell tools of a few Debian packages, python3 with its
    # stdlib, and exactly the shared libraries they load (found with ldd).
    list=$(mktemp)
    /usr/bin/python3 - "$list" <<'PY'
import os, re, subprocess, sys
files = set()
for pkg in "dash bash coreutils grep sed findutils procps util-linux tar gzip diffutils".split():
    out = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True).stdout
    files.update(p for p in out.split() if re.match(r"^/(usr/)?s?bin/", p))
py = os.path.realpath("/usr/bin/python3")
files.update({py, "/usr/bin/python3"})
std = "/usr/lib/" + os.path.basename(py)
skip = {"test", "tests", "idlelib", "tkinter", "ensurepip", "lib2to3", "__pycache__"}
for root, dirs, names in os.walk(std):
    dirs[:] = [d for d in dirs if d not in skip and not d.startswith("config-")]
    files.update(os.path.join(root, n) for n in names)
files.update("/etc/" + n for n in "passwd group hosts nsswitch.conf ld.so.cache".split())
for f in sorted(files):
    if os.path.isfile(f) and not os.path.islink(f) and os.access(f, os.X_OK) or f.endswith(".so"):
        out = subprocess.run(["ldd", f], capture_output=True, text=True).stdout
        files.update(re.findall(r"(/\S+\.so[^\s]*)", out))
def canon(p):  # resolve directory symlinks (merged /usr), keep the file's own name
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
entries = set()
for f in files:
    if not os.path.lexists(f):
        continue
    c = canon(f)
    entries.add(c)
    if os.path.islink(c):
        entries.add(os.path.realpath(c))
for e in list(entries):
    d = os.path.dirname(e)
    while d != "/":
        entries.add(d); d = os.path.dirname(d)
entries.update("/" + d for d in ("bin", "sbin", "lib", "lib64") if os.path.islink("/" + d))
with open(sys.argv[1], "w") as out:
    out.writelines(e.lstrip("/") + "\n" for e in sorted(entries))
PY
    tar -C / --numeric-owner --no-recursion -cf - -T "$list" 2>/dev/null \
        | docker import --change 'CMD ["/bin/sh"]' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            - "$IMAGE" >/dev/null
    rm -f "$list"
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || { say "image $IMAGE could not be made"; exit 4; }
say "ready: engine on $SOCK, image $IMAGE"
