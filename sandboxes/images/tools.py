"""The kept tools this package drives, as subprocesses: buildah, skopeo (and mmdebstrap in bootstrap).

Concept: `Buildah` is Debian's buildah with a storage of our own (`<images cache>/containers`,
so a private MILES_ENV_CACHE is a private image store and CI starts empty), our own
registries.conf and signature policy (independent of /etc/containers), and OCI isolation (runc)
for RUN steps. Every call's output goes to a log file; a failure is an ImageError whose message
is one line naming what failed, then the log's last lines. `SkopeoProbe` asks a registry for a
manifest digest (resolve.Probe).

Invariant: nothing here touches the system's container storage or configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .errors import ImageError
from .refs import ImageRef
from .resolve import ProbeFailed

__all__ = ["Buildah", "SkopeoProbe", "log_tail", "need_tool"]

_POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
_REGISTRIES = 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n'
_INSTALL = "bash scripts/install-images.sh"


def need_tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/bin:/sbin")
    if found is None:
        raise ImageError(f"`{name}` is not installed (Debian package {name}): run {_INSTALL}")
    return found


def log_tail(path: Path, lines: int = 25, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


class Buildah:
    def __init__(self, cache: Path) -> None:
        self.binary = need_tool("buildah")
        base = cache / "containers"
        base.mkdir(parents=True, exist_ok=True)
        self.root = base / "storage"
        digest = hashlib.sha256(str(self.root.absolute()).encode()).hexdigest()[:12]
        run_base = Path("/run") if os.geteuid() == 0 and os.access("/run", os.W_OK) else base
        self.runroot = run_base / f"miles-env-images-{digest}"
        self.policy = base / "policy.json"
        self.registries = base / "registries.conf"
        for path, text in ((self.policy, _POLICY), (self.registries, _REGISTRIES)):
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
        self.logs = base / "logs"
        self.logs.mkdir(exist_ok=True)

    def _argv(self, args: list[str]) -> list[str]:
        return [self.binary, "--root", str(self.root), "--runroot", str(self.runroot), *args]

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_REGISTRIES_CONF": str(self.registries), "BUILDAH_ISOLATION": "oci"}

    def run(self, args: list[str], what: str, *, timeout: float, log: Path | None = None) -> str:
        """Run buildah; its stdout on success, an ImageError with the log's tail otherwise."""
        log = log or self.logs / "last.log"
        with log.open("wb") as out:
            try:
                proc = subprocess.run(
                    self._argv(args), stdout=subprocess.PIPE, stderr=out, env=self._env(), timeout=timeout
                )
            except subprocess.TimeoutExpired as e:
                raise ImageError(f"{what}: still running after {timeout:.0f} s\n{log_tail(log)}") from e
        stdout = proc.stdout.decode(errors="replace")
        if proc.returncode != 0:
            with log.open("ab") as out:
                out.write(proc.stdout)
            raise ImageError(f"{what}: buildah exited {proc.returncode} (log {log})\n{log_tail(log)}")
        return stdout

    def exists(self, name: str) -> bool:
        proc = subprocess.run(
            self._argv(["inspect", "--type", "image", "--format", "{{.FromImageID}}", name]),
            capture_output=True,
            env=self._env(),
            timeout=60,
        )
        return proc.returncode == 0

    def inspect(self, name: str) -> dict[str, Any]:
        out = self.run(["inspect", "--type", "image", name], f"inspecting {name}", timeout=60)
        data: dict[str, Any] = json.loads(out)
        return data

    def pull(self, ref: str, insecure: bool, timeout: float) -> str:
        args = ["pull", "--quiet", f"--tls-verify={str(not insecure).lower()}"]
        args += ["--signature-policy", str(self.policy), f"docker://{ref}"]
        return self.run(args, f"pulling {ref}", timeout=timeout).strip().splitlines()[-1]

    def build(
        self, context: Path, dockerfile: Path, tag: str, *, network: str, timeout: float, log: Path
    ) -> str:
        iid = log.with_suffix(".iid")
        args = [
            "build",
            "--pull=never",
            "--signature-policy",
            str(self.policy),
            "--network",
            network,
            "--format",
            "docker",  # Docker's image format, as `docker build` makes: OCI's has no SHELL (buildah drops it)
        ]
        args += ["--isolation", "oci", "--iidfile", str(iid), "-f", str(dockerfile), "-t", tag, str(context)]
        before = self.containers()
        try:
            self.run(args, f"building {dockerfile}", timeout=timeout, log=log)
        except ImageError:
            self._remove_left(before, dockerfile)
            raise
        return iid.read_text().strip()

    def containers(self) -> dict[str, str]:
        """The storage's working containers: id -> the id of the image they were made from."""
        out = self.run(["containers", "--json"], "listing containers", timeout=60)
        return {c["id"]: c.get("imageid", "") for c in json.loads(out or "[]") or []}

    def _remove_left(self, before: dict[str, str], dockerfile: Path) -> None:
        """A failed build keeps its working container (and its mount): remove the ones it made.

        New since the build started and made from an image its FROM lines name (the lowered
        Dockerfile names only our local base names), so another build's are left alone unless it
        started at the same moment from the same base."""
        ids = set()
        for line in dockerfile.read_text().splitlines():
            words = [w for w in line.split() if not w.startswith("--")]
            if len(words) >= 2 and words[0].upper() == "FROM":
                proc = subprocess.run(
                    self._argv(["inspect", "--type", "image", "--format", "{{.FromImageID}}", words[1]]),
                    capture_output=True,
                    text=True,
                    env=self._env(),
                    timeout=60,
                )
                ids.add(proc.stdout.strip())
        for cid, image in self.containers().items():
            if cid not in before and image in ids:
                subprocess.run(self._argv(["rm", cid]), capture_output=True, env=self._env(), timeout=120)


class SkopeoProbe:
    """resolve.Probe over skopeo (credentials: the usual containers auth file, `skopeo login`)."""

    def __init__(self, timeout: float) -> None:
        self.binary = need_tool("skopeo")
        self.timeout = timeout

    def digest(self, ref: ImageRef, insecure: bool) -> str:
        argv = [self.binary, "inspect", "--no-tags", "--format", "{{.Digest}}"]
        argv += [f"--tls-verify={str(not insecure).lower()}", f"docker://{ref.full}"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            raise ProbeFailed(f"no answer in {self.timeout:.0f} s") from e
        if proc.returncode != 0:
            raise ProbeFailed(_short(proc.stderr))
        return proc.stdout.strip()


def _short(stderr: str) -> str:
    """skopeo's fatal line, trimmed to its cause (`no such host`, `manifest unknown`, ...)."""
    line = stderr.strip().splitlines()[-1] if stderr.strip() else "failed"
    line = line.split('msg="', 1)[-1].rstrip('"')
    for cause in ("no such host", "manifest unknown", "connection refused", "unauthorized", "not found"):
        if cause in line.lower():
            return cause
    return line[-160:]
