"""The kept tools this package drives, as subprocesses: buildah, skopeo (and mmdebstrap in bootstrap).

Concept: `Buildah` is Debian's buildah with a storage of our own (`<images cache>/containers`,
so a private MILES_ENV_CACHE is a private image store and CI starts empty), our own
registries.conf and signature policy (independent of /etc/containers), and OCI isolation (runc)
for RUN steps. Every call's output goes to a log file; a failure is an ImageError whose message
is one line naming what failed, then the log's last lines. `SkopeoProbe` asks a registry for a
manifest digest (resolve.Probe).

Invariant: nothing here touches the system's container storage or configuration, and no mount
or process of ours outlives the call that made it, however it ends (tests/test_images_cleanup.py).
As root (where root may make namespaces), every buildah call that mounts (`build`, `unpack`) runs
in a mount and pid namespace of its own (util-linux `unshare`, `setpriv --pdeathsig`): what it
mounted is gone with the namespace, and every process it started (runc, the RUN steps) dies with
it, even when buildah is SIGKILLed. A call past its timeout (or interrupted) gets SIGTERM first,
which buildah answers by removing its running step, its working container and its mount; SIGKILL
after a grace period. Buildah gets the same SIGTERM when our process dies, however it dies
(unshare's pdeathsig, then its --kill-child=TERM). And a build removes its own working containers
on every exit: buildah 1.28 keeps (mounted) the container of a stage without instructions (`FROM x`
alone, a stage only `COPY --from`'d), so each build carries a build arg with a nonce
(`MILES_ENV_BUILD_ID`, unconsumed: the image is unchanged) by which its own containers are told
from a concurrent build's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from .errors import ImageError
from .refs import ImageRef
from .resolve import ProbeFailed

__all__ = ["Buildah", "SkopeoProbe", "log_tail", "need_tool", "system_env"]

_POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
_REGISTRIES = 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n'
_INSTALL = "bash scripts/install-images.sh"
_MARK = "MILES_ENV_BUILD_ID"  # the build arg that names a build's own working containers
_GRACE_S = 30.0  # after SIGTERM, before SIGKILL: buildah cleans up in well under a second
# The image's files copied out of a mount made (and undone) in the call's namespace; "$@" is buildah
_UNPACK = (
    'm=$("$@" mount "$CTR") || exit 1; cp -a "$m/." "$DEST"; rc=$?; "$@" umount "$CTR" >/dev/null; exit $rc'
)

_logger = logging.getLogger(__name__)


def need_tool(name: str) -> str:
    found = shutil.which(name, path=system_env()["PATH"])
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

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**system_env(), "CONTAINERS_REGISTRIES_CONF": str(self.registries), "BUILDAH_ISOLATION": "oci"}
        return {**env, **(extra or {})}

    def run(
        self,
        args: list[str],
        what: str,
        *,
        timeout: float,
        log: Path | None = None,
        isolated: bool = False,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        interleaved: bool = False,
    ) -> str:
        """Run buildah (or `argv`); its stdout on success, an ImageError with the log's tail otherwise.

        `isolated`: in a mount and pid namespace of its own (as root; the module says why).
        `interleaved`: stdout goes to the log with stderr, in the order printed, and "" is returned
        (a build: its RUN steps print on both, and the failing step's own lines must end the log)."""
        log = log or self.logs / "last.log"
        command = (_isolation() if isolated else []) + (argv or self._argv(args))
        with log.open("wb") as out:
            stdout, stderr = (out, subprocess.STDOUT) if interleaved else (subprocess.PIPE, out)
            proc = subprocess.Popen(
                command, stdout=stdout, stderr=stderr, env=self._env(env), start_new_session=True
            )
            try:
                stdout_b, _ = proc.communicate(timeout=timeout)
            except BaseException as e:  # past the timeout, or interrupted: buildah cleans up first
                _stop(proc)
                out.write(_rest(proc))
                out.flush()
                if isinstance(e, subprocess.TimeoutExpired):
                    raise ImageError(f"{what}: still running after {timeout:.0f} s\n{log_tail(log)}") from e
                raise
        stdout_b = stdout_b or b""
        if proc.returncode != 0:
            with log.open("ab") as out:
                out.write(stdout_b)
            raise ImageError(f"{what}: buildah exited {proc.returncode} (log {log})\n{log_tail(log)}")
        return stdout_b.decode(errors="replace")

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
        nonce = secrets.token_hex(8)
        args += ["--build-arg", f"{_MARK}={nonce}"]
        args += ["--isolation", "oci", "--iidfile", str(iid), "-f", str(dockerfile), "-t", tag, str(context)]
        before = set(self.containers())
        try:
            self.run(
                args, f"building {dockerfile}", timeout=timeout, log=log, isolated=True, interleaved=True
            )
        finally:
            self._remove_own(before, nonce)
        return iid.read_text().strip()

    def containers(self) -> dict[str, str]:
        """The storage's working containers: id -> the id of the image they were made from."""
        out = self.run(["containers", "--json"], "listing containers", timeout=60)
        return {c["id"]: c.get("imageid", "") for c in json.loads(out or "[]") or []}

    def _remove_own(self, before: set[str], nonce: str) -> None:
        """Remove the working containers the build with `nonce` left (never another build's).

        A container's build args are in buildah's state file beside it (`buildah inspect` does not
        show them). Failures are logged, not raised: the build's own outcome is what the caller sees."""
        try:
            for cid in set(self.containers()) - before:
                if _build_args(self.root, cid).get(_MARK) == nonce:
                    self.run(["rm", cid], f"removing the build's container {cid[:12]}", timeout=120)
        except (ImageError, OSError) as e:
            _logger.warning("images: could not remove a build's working containers: %s", e)

    def unpack(self, image: str, dest: Path, timeout: float) -> None:
        """Copy `image`'s files (owners, modes, links) into `dest`: a working container mounted in a
        namespace of its own (nothing stays mounted however this ends), removed on every exit."""
        name = f"miles-env-unpack-{secrets.token_hex(6)}"
        what = f"unpacking {image[:12]} into {dest}"
        try:
            self.run(["from", "--name", name, "--pull=never", image], what, timeout=120)
            argv = ["sh", "-c", _UNPACK, "unpack", *self._argv([])]
            self.run(
                [], what, timeout=timeout, isolated=True, argv=argv, env={"CTR": name, "DEST": str(dest)}
            )
        finally:
            with contextlib.suppress(ImageError):  # `from` may have failed before making it
                self.run(["rm", name], f"removing {name}", timeout=120)


_SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def system_env() -> dict[str, str]:
    """This process's environment for a kept tool, with the system's binary folders on PATH after
    the caller's own: buildah's CNI plugins look for iptables there, and a non-root login's PATH
    (or a test's narrowed one, while a background build runs) has no /usr/sbin."""
    env = dict(os.environ)
    have = [d for d in env.get("PATH", "").split(os.pathsep) if d]
    env["PATH"] = os.pathsep.join([*have, *(d for d in _SYSTEM_PATH if d not in have)])
    return env


@functools.cache
def _isolation() -> list[str]:
    """The prefix that runs a command in a mount and pid namespace of its own, dying with us (root
    only: rootless buildah makes its own namespaces). Tried once: where root may not make them (a
    container without CAP_SYS_ADMIN), none, said once."""
    if os.geteuid() != 0:
        return []
    # --kill-child=TERM: when we die (so unshare, by its pdeathsig), buildah cleans up as on a timeout
    unshare = ["--mount", "--propagation", "private", "--pid", "--fork", "--kill-child=TERM", "--mount-proc"]
    path = system_env()["PATH"]
    setpriv, unshare_ = shutil.which("setpriv", path=path), shutil.which("unshare", path=path)  # util-linux
    prefix = [setpriv or "setpriv", "--pdeathsig", "KILL", unshare_ or "unshare", *unshare]
    try:
        probe = subprocess.run(
            [*prefix, "true"], capture_output=True, text=True, timeout=60, env=system_env()
        )
        why = probe.stderr.strip()[-200:] if probe.returncode != 0 else None
    except OSError as e:
        why = str(e)
    if why is not None:
        _logger.warning(
            "images: buildah runs in the host's mount namespace (%s): a build killed mid-way may "
            "leave a mount under the image cache",
            why,
        )
        return []
    return prefix


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the call's process group (buildah removes its running step and working
    container), SIGKILL after the grace period; reaped."""
    for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _rest(proc: subprocess.Popen[bytes]) -> bytes:
    """What a stopped call had still to say on stdout (a RUN step's output, for the log)."""
    try:
        return proc.communicate(timeout=5)[0] or b""
    except (subprocess.TimeoutExpired, ValueError):
        return b""


def _build_args(root: Path, cid: str) -> dict[str, str]:
    """A working container's build args, from buildah's state file (`<driver>-containers/<id>/userdata`)."""
    for state in root.glob(f"*-containers/{cid}/userdata/buildah.json"):
        args = json.loads(state.read_text()).get("Args") or {}
        return {str(k): str(v) for k, v in args.items()}
    return {}


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
