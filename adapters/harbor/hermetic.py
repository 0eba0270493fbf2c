"""Hermetic verification: what a task's tests/test.sh installs at verify time, provisioned at build.

Concept: the stock Terminal-Bench 2 verifier installs its tools when it runs (`apt-get install
curl`, astral's uv installer, `uvx -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest ...`,
sometimes `pip install`). `verifier_needs(test.sh)` reads those install commands;
`hermetic_context` makes a build context that is the task's `environment/` plus a layer that
does the same installs while the image builds (network at build time, from the package
registries only), and the verify step then runs with no network:

- uv: the `uv` wheel from PyPI (the version the installer URL names, else DEFAULT_UV), its `uv`
  and `uvx` put where astral's installer puts them (`$HOME/.local/bin`, with the installer's
  `env` script), for root right after the final FROM (so a Dockerfile that runs the installer
  and then copies `/root/.local/bin/uv` finds it) and for the image's final USER;
- apt-get and pip installs: the same commands, run at the end of the build as root;
- each `uvx`/`uv tool run` of test.sh run once at build with the tool's `--version`, so uv's
  cache (UV_CACHE_DIR, shared, world-writable) holds the resolved packages; a `-p 3.x` it asks
  for is the image's, else its apt's (python3.x), else a portable uv-managed CPython made from
  the packages of the distribution that builds it (pythons.py: Debian trixie's 3.13 on Ubuntu
  noble, Ubuntu noble's 3.12 on bookworm): uv never downloads a Python here
  (UV_PYTHON_DOWNLOADS=never);
- at verify time: `VERIFY_ENV` (UV_OFFLINE=1, the same UV_CACHE_DIR, PIP_NO_INDEX=1): offline
  the installer's `curl | sh` is a no-op that exits 0, `apt-get update` warns and exits 0, an
  installed package's `apt-get install` and a satisfied `pip install` exit 0.

What is not provisioned (downloads from other hosts: `curl`/`wget` of a URL, `git clone`, npm)
is listed in `/opt/miles-hermetic/provision.log` with every step that failed, and the verifier's
output says so.

`agent_user_context` derives one more context the same way: Harbor's `[agent] user` as a last
`USER` line (the image's USER for every exec that names no other).

Invariant: the derived context is content-addressed (the task's context, test.sh, this recipe);
the task's own files are never changed; nothing here runs at verify time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from miles_env.adapters.harbor.pythons import FOREIGN_PYTHONS, INSTALL_SH, portable_python
from miles_env.errors import TaskError
from miles_env.sandboxes.images.errors import ImageError
from miles_env.sandboxes.images.wheels import download

__all__ = [
    "DEFAULT_UV",
    "VERIFY_ENV",
    "VerifierNeeds",
    "agent_user_context",
    "hermetic_context",
    "verifier_needs",
]

DEFAULT_UV = "0.9.5"  # the stock TB 2.x test.sh's installer version
HERMETIC = "/opt/miles-hermetic"
VERIFY_ENV = {
    "UV_OFFLINE": "1",
    "UV_PYTHON_DOWNLOADS": "never",
    "UV_CACHE_DIR": f"{HERMETIC}/uv-cache",
    "PIP_NO_INDEX": "1",
}
_RECIPE = "3"  # bump when the layer below changes: every derived context is rebuilt
_INSTALLER = re.compile(r"astral\.sh/uv/(?:(\d+\.\d+\.\d+)/)?install\.sh")
_FETCH = re.compile(r"\b(curl|wget)\b[^|;&\n]*https?://|\bgit clone\b|\bnpm (install|i|ci)\b")
_APT = re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\b")
_PIP = re.compile(r"(?:^|\s)(?:python3?\s+-m\s+pip|pip3?|uv\s+pip)\s+install\b")
_UVX = re.compile(r"^(?:uvx|uv\s+tool\s+run)\s")
_VALUE_OPTS = {"-p", "--python", "-w", "--with", "--from", "--with-requirements", "--index", "--index-url",
               "--extra-index-url", "-c", "--constraint", "--with-editable"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class VerifierNeeds:
    uv_version: str | None = None  # astral's installer runs (its version, or DEFAULT_UV)
    installs: tuple[str, ...] = ()  # apt-get / pip commands, in test.sh order
    uvx: tuple[str, ...] = ()  # `uvx OPTS TOOL --version` per uvx invocation
    other: tuple[str, ...] = ()  # downloads from elsewhere, not provisioned

    @property
    def any(self) -> bool:
        return bool(self.uv_version or self.installs or self.uvx)


def _commands(text: str) -> list[str]:
    """Simple commands of a shell script: continuations joined, split at ; && || and newlines."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        out += [c.strip() for c in re.split(r"&&|\|\||;", line) if c.strip()]
    return out


def _uvx_warm(cmd: str) -> str | None:
    """`uvx OPTS TOOL ARGS...` -> `uvx OPTS TOOL --version` (the tool's environment, no tests run)."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        return None
    head = 3 if words[:2] == ["uv", "tool"] else 1
    i = head
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in _VALUE_OPTS else 1
    if i >= len(words):
        return None
    tool = words[i]
    probe = ["-c", "pass"] if tool.startswith("python") else ["--version"]
    return shlex.join(["uvx", *words[head:i], tool, *probe])


def verifier_needs(test_sh: str) -> VerifierNeeds:
    uv, installs, uvx, other = None, [], [], []
    if m := _INSTALLER.search(test_sh):
        uv = m.group(1) or DEFAULT_UV
    for cmd in _commands(test_sh):
        cmd = re.sub(r"^(sudo\s+|\w+=\S*\s+)+", "", cmd)
        if _INSTALLER.search(cmd):
            continue
        if _APT.search(cmd) or _PIP.search(cmd) or re.match(r"apt(-get)?\s+update\b", cmd):
            installs.append(re.sub(r"\s*[12]?>\s*/dev/null.*$", "", cmd))
        elif _UVX.match(cmd):
            if (warm := _uvx_warm(cmd)) is not None:
                uvx.append(warm)
        elif _FETCH.search(cmd):
            other.append(cmd[:160])
    return VerifierNeeds(uv, tuple(dict.fromkeys(installs)), tuple(dict.fromkeys(uvx)), tuple(other))


def _python_request(warm: str) -> str:
    words = shlex.split(warm)
    for i, w in enumerate(words[:-1]):
        if w in ("-p", "--python"):
            return words[i + 1]
        if w.startswith("--python="):
            return w.split("=", 1)[1]
    return ""


def _provision_script(needs: VerifierNeeds, user: str | None, pythons: dict[str, str] | None = None) -> str:
    """The build-time script (run as root): installs, a Python for each uvx, uvx warmed, uv for
    the final user; each step logged, none fatal (the verify says what is missing)."""
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        "# miles-env hermetic verification: test.sh's installs, made at image build time",
        f"H={HERMETIC}; log=$H/provision.log; : > $log",
        'step() { if sh -c "$1" >>$H/provision.out 2>&1; then echo "ok: $1" >>$log; '
        'else echo "FAILED ($?): $1" >>$log; fi; }',
        f"export DEBIAN_FRONTEND=noninteractive UV_CACHE_DIR={VERIFY_ENV['UV_CACHE_DIR']} "
        "UV_PYTHON_DOWNLOADS=never PATH=$H/bin:$PATH",
        # uv trusts the system's CA store, which holds the build host's own CAs (a TLS-inspecting
        # proxy's, as the bootstrap copies them), not only its bundled roots
        "ca=/etc/ssl/certs/ca-certificates.crt",
        "[ -s $ca ] || step 'apt-get update && apt-get install -y --no-install-recommends ca-certificates'",
        "[ -s $ca ] && export UV_NATIVE_TLS=1 SSL_CERT_FILE=$ca PIP_CERT=$ca REQUESTS_CA_BUNDLE=$ca",
    ]
    lines += [f"step {q(cmd)}" for cmd in needs.installs]
    name = (user or "").split(":")[0] if user not in (None, "root", "0") else ""
    for warm in needs.uvx:
        want = _python_request(warm)
        pkg = f"python{want}" if re.fullmatch(r"3\.\d+", want) else "python3"
        lines.append(
            f"command -v {pkg} >/dev/null 2>&1 || step {q(f'apt-get update && apt-get install -y --no-install-recommends {pkg}')}"
        )
        if version := (pythons or {}).get(want):
            install = f"sh {HERMETIC}/install-python.sh {version} {q(name)}"
            managed = f"/root/.local/share/uv/python/cpython-{version}-linux-$(uname -m)-gnu"
            lines.append(f"command -v {pkg} >/dev/null 2>&1 || [ -d {managed} ] || step {q(install)}")
        lines.append(f"step {q(warm)}")
    lines.append("mkdir -p $UV_CACHE_DIR && chmod -R a+rwX $UV_CACHE_DIR")
    if user and user not in ("root", "0"):
        lines += [
            f"home=$(getent passwd {q(user.split(':')[0])} | cut -d: -f6)",
            'if [ -n "$home" ]; then mkdir -p "$home/.local/bin" && cp -p $H/bin/uv $H/bin/uvx $H/bin/env '
            f'"$home/.local/bin/" && chown -R {q(user)} "$home/.local"; fi',
        ]
    for other in needs.other:
        lines.append(
            f"echo {q('NOT PROVISIONED (needs a host other than the package registries): ' + other)} >>$log"
        )
    return "\n".join(lines) + "\n"


_ENV_SCRIPT = """#!/bin/sh
# add binaries to PATH if they aren't added yet (as astral's uv installer writes it)
case ":${PATH}:" in
    *:"$HOME/.local/bin":*)
        ;;
    *)
        export PATH="$HOME/.local/bin:$PATH"
        ;;
esac
"""


def uv_binaries(version: str, cache: Path) -> Path:
    """A folder with `uv` and `uvx` of `version`, from its PyPI wheel (downloaded once)."""
    out = cache / "uv" / version
    if (out / "uv").is_file() and (out / "uvx").is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="miles-uv-") as tmp:
        try:
            wheel = download(f"uv=={version}", Path(tmp))
        except ImageError as e:
            raise TaskError(str(e)) from e
        stage = Path(tmp) / "bin"
        stage.mkdir()
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.endswith(("/scripts/uv", "/scripts/uvx")):
                    target = stage / Path(name).name
                    target.write_bytes(z.read(name))
                    target.chmod(0o755)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(str(stage), out)
    return out


def _final_user(dockerfile: str) -> str | None:
    from miles_env.adapters.harbor.taskdir import final_stage

    users = [i.args.strip() for i in final_stage(dockerfile) if i.op == "USER"]
    return users[-1] if users else None


def _layered(dockerfile: str, user: str | None) -> str:
    """The task's Dockerfile with uv placed for root after its final FROM and the provisioning
    layer at its end (as root, then back to the task's USER)."""
    lines = dockerfile.splitlines()
    froms = [i for i, ln in enumerate(lines) if re.match(r"(?i)\s*FROM\s", ln)]
    at = froms[-1] + 1 if froms else 0
    while at < len(lines) and lines[at - 1].rstrip().endswith("\\"):
        at += 1
    place = ["# miles-env hermetic verification: uv where astral's installer puts it",
             "COPY .miles-hermetic/bin/ /root/.local/bin/"]  # fmt: skip
    tail = ["", "# miles-env hermetic verification: test.sh's installs, at build time", "USER root",
            "COPY .miles-hermetic/ /opt/miles-hermetic/",
            'RUN ["/bin/sh", "/opt/miles-hermetic/provision.sh"]']  # fmt: skip
    if user:
        tail.append(f"USER {user}")
    return "\n".join([*lines[:at], *place, *lines[at:], *tail]) + "\n"


def _tree_key(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _copy_tree(src: Path, dst: Path) -> None:
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, symlinks=True, copy_function=link)


def hermetic_context(env_dir: Path, test_scripts: list[str], cache: Path) -> tuple[Path, VerifierNeeds]:
    """The build context with the provisioning layer (made once per content), and what it
    provisions; `env_dir` itself when the tests install nothing."""
    needs = verifier_needs("\n".join(test_scripts))
    if not needs.any:
        return env_dir, needs
    dockerfile = (env_dir / "Dockerfile").read_text()
    key = hashlib.sha256("\0".join([_RECIPE, _tree_key(env_dir), dockerfile, *test_scripts]).encode())
    out = cache / "contexts" / key.hexdigest()[:32]
    if (out / "Dockerfile").is_file():
        return out, needs
    user = _final_user(dockerfile)
    uv = uv_binaries(needs.uv_version or DEFAULT_UV, cache)
    tmp = Path(tempfile.mkdtemp(prefix="ctx-", dir=_mkdir(cache / "contexts")))
    try:
        _copy_tree(env_dir, tmp / "ctx")
        ctx = tmp / "ctx"
        extra = ctx / ".miles-hermetic"
        (extra / "bin").mkdir(parents=True)
        for name in ("uv", "uvx"):
            shutil.copy2(uv / name, extra / "bin" / name)
        (extra / "bin" / "env").write_text(_ENV_SCRIPT)
        (extra / "bin" / "env").chmod(0o755)
        pythons = _stage_pythons(needs, extra, cache)
        (extra / "provision.sh").write_text(_provision_script(needs, user, pythons))
        (ctx / "Dockerfile").unlink()
        (ctx / "Dockerfile").write_text(_layered(dockerfile, user))
        ignore = ctx / ".dockerignore"
        if ignore.is_file():
            text = ignore.read_text()
            ignore.unlink()
            ignore.write_text(text.rstrip("\n") + "\n!.miles-hermetic\n!.miles-hermetic/**\n")
        try:
            ctx.rename(out)
        except OSError:  # another process made it first: same content
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, needs


def _stage_pythons(needs: VerifierNeeds, extra: Path, cache: Path) -> dict[str, str]:
    """For each `-p 3.X` a distribution here builds: its portable CPython in extra/python (the
    runtime where the image keeps it, the installation for install-python.sh to place); returns
    {minor: full version} of what was staged."""
    staged = {}
    for minor in dict.fromkeys(_python_request(w) for w in needs.uvx):
        found = portable_python(minor, cache) if minor in FOREIGN_PYTHONS else None
        if found is None:
            continue
        folder, version = found
        for part in sorted(folder.iterdir()):
            if part.is_dir():
                _copy_tree(part, extra / "python" / part.name)
        staged[minor] = version
    if staged:
        (extra / "install-python.sh").write_text(INSTALL_SH)
    return staged


def agent_user_context(context: Path, user: str, cache: Path) -> Path:
    """`context` (the task's, or its hermetic one) with a last `USER <user>`: Harbor's `[agent] user`
    as the image's USER, so every exec runs as it unless it names another (the verifier does).
    Made once per content; the hermetic layer before it keeps provisioning for the task's own USER."""
    dockerfile = (context / "Dockerfile").read_text()
    key = hashlib.sha256("\0".join(["agent-user", _tree_key(context), dockerfile, user]).encode())
    out = cache / "contexts" / key.hexdigest()[:32]
    if (out / "Dockerfile").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(prefix="ctx-", dir=_mkdir(cache / "contexts")))
    try:
        _copy_tree(context, tmp / "ctx")
        (tmp / "ctx" / "Dockerfile").unlink()  # a hard link to the task's own: replaced, never written
        (tmp / "ctx" / "Dockerfile").write_text(
            dockerfile.rstrip("\n") + f"\n\n# miles-env: Harbor's [agent] user\nUSER {user}\n"
        )
        try:
            (tmp / "ctx").rename(out)
        except OSError:  # another process made it first: same content
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
