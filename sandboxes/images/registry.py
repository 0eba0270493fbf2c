"""The loopback registry: Debian's `docker-registry` serving the bootstrapped bases on 127.0.0.1.

Concept: `miles-env images bootstrap` pushes Debian bases here, and builds pull them from here
over the registry API, the same path a user's own registry or mirror takes. Its storage is
`<images cache>/registry`, kept across runs; the server is a child of whichever process needs it
first (a lookup, a pull, a push), on a free port, and stops when that process exits, however it
exits (a SIGKILL too: a watcher holding a pidfd of the server SIGTERMs it when the pipe only we
hold closes), so no daemon outlives a run. Several processes may each run one over the same storage: the registry
writes blobs by content address and uploads under unique names.

Invariant: it listens on 127.0.0.1 only (a build's RUN steps run in a network namespace of their
own by default, so they do not reach it); nothing but bootstrap writes to it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .errors import ImageError

__all__ = ["LoopbackRegistry", "registry_for", "MANIFEST_TYPES"]

MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
# The watcher: SIGTERM the server through its pidfd (never another process that got its pid) at EOF
_WATCH = "import signal, sys; sys.stdin.buffer.read(); signal.pidfd_send_signal(int(sys.argv[1]), 15)"
_CONFIG = """version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackRegistry:
    def __init__(self, root: Path, binary: str | None = None) -> None:
        self.root = root
        self.binary = binary or shutil.which("docker-registry") or "/usr/bin/docker-registry"
        self._proc: subprocess.Popen[bytes] | None = None
        self._addr: str | None = None
        self._watch: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def address(self) -> str:
        """`127.0.0.1:PORT` of the running server (started now if this process has none)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._addr is not None:
                return self._addr
            return self._start()

    def _start(self) -> str:
        if not Path(self.binary).is_file():
            raise ImageError(
                "the loopback registry needs Debian's docker-registry: bash scripts/install-images.sh "
                "(apt-get install docker-registry)"
            )
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # a port taken between the probe and the bind: try another
            port = _free_port()
            config = self.root / f"config-{port}.yml"
            config.write_text(_CONFIG.format(root=self.root / "data", port=port))
            log = (self.root / "registry.log").open("ab")
            proc = subprocess.Popen(
                [self.binary, "serve", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
            log.close()
            addr = f"127.0.0.1:{port}"
            if self._wait(proc, addr):
                config.unlink(missing_ok=True)
                self._end_watch()  # a server that died before: its watcher's
                self._proc, self._addr, self._watch = proc, addr, _watcher(proc.pid)
                return addr
            proc.kill()
            proc.wait()
            config.unlink(missing_ok=True)
        tail = (self.root / "registry.log").read_text(errors="replace")[-400:]
        raise ImageError(f"the loopback registry ({self.binary}) did not start: {tail.strip()}")

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], addr: str) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{addr}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.03)
        return False

    def digest(self, repository: str, tag: str) -> str | None:
        """The manifest digest of `repository:tag` here, or None when it has none."""
        req = urllib.request.Request(
            f"http://{self.address()}/v2/{repository}/manifests/{tag}",
            method="HEAD",
            headers={"Accept": MANIFEST_TYPES},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.headers.get("Docker-Content-Digest")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise ImageError(f"loopback registry: HEAD {repository}:{tag}: HTTP {e.code}") from e
        except (urllib.error.URLError, OSError) as e:
            raise ImageError(f"loopback registry: HEAD {repository}:{tag}: {e}") from e

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._end_watch()
            self._proc = self._addr = None

    def _end_watch(self) -> None:
        if self._watch is not None:
            if self._watch.stdin is not None:
                self._watch.stdin.close()
            self._watch.wait()
            self._watch = None


def _watcher(pid: int) -> subprocess.Popen[bytes]:
    """A process that SIGTERMs our child `pid` once our end of its stdin closes: at stop(), or when
    we die. The pidfd is opened here, while `pid` is our unreaped child (so surely that process)."""
    pidfd = os.pidfd_open(pid)
    try:
        return subprocess.Popen(
            [sys.executable, "-S", "-E", "-c", _WATCH, str(pidfd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(pidfd,),
        )
    finally:
        os.close(pidfd)


_REGISTRIES: dict[Path, LoopbackRegistry] = {}
_GUARD = threading.Lock()


def registry_for(cache: Path) -> LoopbackRegistry:
    """This process's registry over `<cache>/registry` (one per cache directory)."""
    root = (cache / "registry").absolute()
    with _GUARD:
        if root not in _REGISTRIES:
            _REGISTRIES[root] = LoopbackRegistry(root)
        return _REGISTRIES[root]


@atexit.register
def _stop_all() -> None:
    for reg in list(_REGISTRIES.values()):
        reg.stop()
