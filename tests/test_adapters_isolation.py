"""Isolation of framework workers: the framework's own code runs inside the episode's bubblewrap sandbox.

The probe (adapters/examples/vf_probe.py, ours) is a real verifiers taskset whose reward
functions try to write a host file outside the workspace, read a file under the host's
$HOME and connect to a port on the host's loopback. With `isolation="none"` (the worker
on the host) all three succeed, which shows the probe can see an escape; with the
default `isolation="sandbox"` all three fail, and afterwards neither the worker process
nor the sandbox's directory is left.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

import miles_env.adapters as adapters_pkg
from miles_env.adapters.framework_harness import FrameworkHarness
from miles_env.adapters.isolation import Isolation, adapter_sandbox_spec, isolation_of, ro_paths
from miles_env.adapters.venv import venv_dir
from miles_env.adapters.worker_pool import close_workers
from miles_env.errors import ConfigError
from miles_env.registry import load_environment
from miles_env.types import SandboxSpec, Status

EXAMPLES = Path(adapters_pkg.__file__).parent / "examples"


def _live_cmdlines(needle: str) -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(cmd)
    return out


def test_isolation_option_is_validated() -> None:
    assert isolation_of(None) is Isolation.SANDBOX
    assert FrameworkHarness(isolation="none").config["isolation"] is Isolation.NONE
    with pytest.raises(ConfigError, match="isolation='docker'"):
        FrameworkHarness(isolation="docker")


def test_ro_paths_cover_venv_python_and_files_without_nesting(tmp_path: Path) -> None:
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    paths = ro_paths("verifiers", [str(tmp_path / "a"), str(inner), "/usr/lib"])
    assert str(tmp_path / "a") in paths and str(inner) not in paths  # nested: the parent shows it
    assert "/usr/lib" not in paths  # system dirs are in every sandbox already
    if (venv_dir("verifiers") / "pyvenv.cfg").exists():
        assert str(venv_dir("verifiers")) in paths
        assert any(Path(p, "bin").is_dir() and p != str(venv_dir("verifiers")) for p in paths)


def test_spawn_streams_and_dies_with_the_sandbox() -> None:
    from miles_env.sandboxes.local import LocalSandboxProvider
    from miles_env.sandboxes.local.spawn import release, spawn

    async def main() -> None:
        sb = await LocalSandboxProvider().create(SandboxSpec())
        proc = await spawn(sb, ["/bin/sh", "-c", "while read l; do echo got:$l; done"])
        assert proc.stdin is not None and proc.stdout is not None
        await proc.stdin.send(b"one\n")
        assert await proc.stdout.receive() == b"got:one\n"
        await proc.stdin.send(b"two\n")
        assert await proc.stdout.receive() == b"got:two\n"
        await sb.close()  # kills the spawned process with the sandbox
        with anyio.fail_after(10):
            await proc.wait()
        assert proc.returncode is not None and proc.returncode != 0
        release(sb, proc)  # closes our ends of its pipes
        try:
            await proc.stdout.receive()
            raise AssertionError("stdout still open after release()")
        except anyio.EndOfStream:
            pass
        await proc.aclose()
        assert not sb.host_dir.exists()

    anyio.run(main)


def _probe_episode(tmp_path: Path, isolation: str) -> tuple[Any, dict[str, float]]:
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses import get_harness
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("verifiers")
    ts = tmp_path / f"ts-{isolation}"
    ts.mkdir()
    shutil.copy(EXAMPLES / "vf_probe.py", ts / "vf_probe.py")
    secret = Path.home() / f".miles-env-probe-{uuid.uuid4().hex}"
    listener = socket.create_server(("127.0.0.1", 0))
    outside = ts / "escaped.txt"
    (ts / "probe.json").write_text(
        f'{{"outside": "{outside}", "secret": "{secret}", "port": {listener.getsockname()[1]}}}'
    )
    root = Path(tempfile.mkdtemp(prefix="mi-"))  # short: expose() binds a Unix socket under it
    env = load_environment(f"verifiers:{ts / 'vf_probe.py'}")
    (task,) = env.tasks("test")

    async def main() -> Any:
        engine = ScriptedEngine(load_tokenizer("smollm2"), ["hello"])
        cfg = StackConfig(sandbox={"provider": "local", "root_dir": str(root)})
        async with open_stack(cfg, engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework", isolation=isolation))
            ep = await run_episode(ctx, task)
        await close_workers()
        return ep

    secret.write_text("host secret")
    try:
        ep = anyio.run(main)
    finally:
        secret.unlink()
        listener.close()
        leftovers = list(root.iterdir())
        shutil.rmtree(root, ignore_errors=True)
    assert ep.status is Status.COMPLETED, ep.error
    assert not leftovers  # the sandbox is gone
    assert not _live_cmdlines(str(ts))  # and so is the worker
    assert outside.exists() == (isolation == "none")
    return ep, ep.reward.details["rewards"]


@pytest.mark.slow
def test_sandboxed_framework_code_cannot_escape(tmp_path: Path) -> None:
    _, rewards = _probe_episode(tmp_path, "sandbox")
    assert rewards == {"wrote_outside": 0.0, "read_home": 0.0, "reached_host": 0.0}


@pytest.mark.slow
def test_the_probe_sees_escapes_without_isolation(tmp_path: Path) -> None:
    """Without the sandbox the same probe escapes: the test above can fail."""
    _, rewards = _probe_episode(tmp_path, "none")
    assert rewards == {"wrote_outside": 1.0, "read_home": 1.0, "reached_host": 1.0}


@pytest.mark.slow
def test_sandboxed_worker_failure_is_a_failed_episode_and_leaves_nothing(tmp_path: Path) -> None:
    """A worker that cannot start inside the sandbox fails its episode with the error kept."""
    from miles_env.adapters.venv import install
    from miles_env.harness import Endpoint
    from miles_env.sandboxes.local import LocalSandboxProvider

    install("openenv")
    env = load_environment(f"openenv:{EXAMPLES / 'openenv_guess.py'}:app")
    task = env.tasks()[0].model_copy(update={"metadata": {**env.tasks()[0].metadata, "target": "nope:app"}})

    async def main() -> tuple[Any, Path]:
        provider = LocalSandboxProvider()
        async with await provider.create(adapter_sandbox_spec()) as sb:
            harness = FrameworkHarness()
            res = await harness.run(task, sb, Endpoint("http://127.0.0.1:9/v1", "k", "m"))
            assert not _live_cmdlines("openenv_worker.py nope:app")
        return res, sb.host_dir

    res, host_dir = anyio.run(main)
    assert res.status is Status.FAILED and "No module named 'nope'" in (res.error or "")
    assert not host_dir.exists()


def test_non_local_episode_sandbox_gets_a_private_local_one() -> None:
    """With a docker/cloud episode sandbox the worker still runs in a local sandbox, closed after."""
    from miles_env.adapters.isolation import _worker_box
    from miles_env.sandboxes.local import LocalSandbox

    class Remote:  # stands for a docker or cloud sandbox: not a LocalSandbox
        pass

    async def main() -> Path:
        async with _worker_box(Remote()) as box:  # type: ignore[arg-type]
            assert isinstance(box, LocalSandbox)
            assert (await box.exec("echo inside")).stdout == "inside\n"
            return box.host_dir

    assert not anyio.run(main).exists()
