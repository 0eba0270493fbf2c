"""SandboxPool over the real local provider (concurrency, warm, cancellation, reaper) and a throttling fake (retry)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest
from rootfs_support import IMAGE, ImageProvider, build_rootfs
from sandbox_contract import SandboxContract, host_http_server  # noqa: F401

from miles_env.errors import SandboxError, SandboxThrottled
from miles_env.sandbox import SandboxProvider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.pool import RetryPolicy, SandboxPool, reap
from miles_env.types import SandboxSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def root(tmp_path):
    return tmp_path / "sandboxes"


@pytest.fixture
def local(root) -> LocalSandboxProvider:
    return LocalSandboxProvider(LocalSandboxConfig(root_dir=str(root)))


@pytest.fixture(scope="session")
def contract_rootfs(tmp_path_factory) -> str:
    return str(build_rootfs(tmp_path_factory.mktemp("contract-image")))


@pytest.fixture
def image_spec(contract_rootfs) -> SandboxSpec:
    return SandboxSpec(rootfs=contract_rootfs)


def _left(root) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


class TestPoolContract(SandboxContract):
    """The pool is a provider: the whole contract holds through it."""

    @pytest.fixture
    def provider(self, root, contract_rootfs):
        images = ImageProvider(LocalSandboxConfig(root_dir=str(root)), {contract_rootfs: IMAGE})
        return SandboxPool(images, max_concurrency=4)


async def test_concurrency_limit(local, root):
    pool = SandboxPool(local, max_concurrency=2)
    a = await pool.create(SandboxSpec())
    b = await pool.create(SandboxSpec())
    assert pool.in_use == 2
    got = []

    async def third() -> None:
        async with await pool.create(SandboxSpec()) as c:
            got.append(await c.exec("echo third"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(third)
        await anyio.sleep(0.3)
        assert got == [] and pool.in_use == 2  # waiting for a slot
        await a.close()
        await a.close()  # idempotent: the slot is given back once
    assert got[0].stdout == "third\n"
    await b.close()
    assert pool.in_use == 0 and _left(root) == []


async def test_warm_sandboxes_are_handed_out_and_refilled(local, root):
    spec = SandboxSpec(files={"seed.txt": "warm"})
    async with SandboxPool(local, max_concurrency=4, warm=2) as pool:
        await pool.prewarm(spec)
        assert len(_left(root)) == 2
        t = time.perf_counter()
        sb = await pool.create(spec)
        warm_s = time.perf_counter() - t
        assert pool.stats.warm_hits == 1 and warm_s < 0.05
        assert (await sb.exec("cat seed.txt")).stdout == "warm"
        await sb.close()
        other = await pool.create(SandboxSpec())  # another spec: made cold
        assert pool.stats.warm_hits == 1
        await other.close()
        with anyio.fail_after(10):
            while len(_left(root)) < 2:  # refilled in the background
                await anyio.sleep(0.02)
    assert _left(root) == []  # leaving the pool closes the warm ones


async def test_expired_warm_sandbox_is_not_handed_out(local, root):
    async with SandboxPool(local, warm=1, ttl_s=0.05) as pool:
        await pool.prewarm(SandboxSpec())
        await anyio.sleep(0.1)
        sb = await pool.create(SandboxSpec())
        assert pool.stats.expired == 1 and pool.stats.warm_hits == 0
        await sb.close()
    assert _left(root) == []


class _Throttling:
    """A provider that refuses `fails` times (rate limit), then delegates to a real one."""

    name = "throttling"

    def __init__(self, inner: SandboxProvider, fails: int, retry_after: float | None = None) -> None:
        self.inner, self.fails, self.calls, self.retry_after = inner, fails, 0, retry_after
        self.times: list[float] = []

    async def create(self, spec: SandboxSpec):
        self.calls += 1
        self.times.append(time.monotonic())
        if self.calls <= self.fails:
            raise SandboxThrottled("429 too many sandboxes", self.retry_after)
        return await self.inner.create(spec)


async def test_retry_on_throttling(local, root):
    fake = _Throttling(local, fails=3)
    pool = SandboxPool(fake, retry=RetryPolicy(attempts=5, base_s=0.01, max_s=0.05))
    async with await pool.create(SandboxSpec()) as sb:
        assert (await sb.exec("echo ok")).ok
    assert fake.calls == 4 and pool.stats.retries == 3


async def test_retry_gives_up_and_frees_the_slot(local, root):
    fake = _Throttling(local, fails=100)
    pool = SandboxPool(fake, max_concurrency=1, retry=RetryPolicy(attempts=3, base_s=0.01))
    with pytest.raises(SandboxThrottled, match="3 attempts"):
        await pool.create(SandboxSpec())
    assert fake.calls == 3 and pool.in_use == 0


async def test_retry_honours_retry_after(local):
    fake = _Throttling(local, fails=1, retry_after=0.3)
    pool = SandboxPool(fake, retry=RetryPolicy(base_s=0.001))
    await (await pool.create(SandboxSpec())).close()
    assert fake.times[1] - fake.times[0] >= 0.3


def test_jitter_is_bounded_and_varies():
    policy = RetryPolicy(base_s=1.0, max_s=8.0)
    delays = [policy.delay(10) for _ in range(200)]
    assert all(0 <= d <= 8.0 for d in delays) and len(set(delays)) > 100
    assert max(policy.delay(0) for _ in range(200)) <= 1.0


async def test_cancelled_create_leaves_nothing(local, root):
    pool = SandboxPool(local, max_concurrency=1)
    for delay in (0.0, 0.001, 0.003, 0.01, 0.03):
        with anyio.move_on_after(delay):
            sb = await pool.create(SandboxSpec(files={f"f{i}.txt": "x" * 1000 for i in range(50)}))
            await sb.close()
        assert _left(root) == [], delay
        assert pool.in_use == 0


async def test_provider_errors_pass_through_and_free_the_slot(local):
    pool = SandboxPool(local, max_concurrency=1)
    with pytest.raises(SandboxError, match="outside"):
        await pool.create(SandboxSpec(files={"/etc/x": "y"}))
    assert pool.in_use == 0


_CRASHER = textwrap.dedent(
    """
    import anyio, json, os, sys
    from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
    from miles_env.sandboxes.pool import SandboxPool
    from miles_env.types import SandboxSpec
    async def main():
        pool = SandboxPool(LocalSandboxProvider(LocalSandboxConfig(root_dir=sys.argv[1])))
        kept = [await pool.create(SandboxSpec()) for _ in range(2)]
        # A process one exec leaves running (the sandbox keeps it, as a container would).
        await kept[1].exec(f"sleep 601.{sys.argv[2]} > /dev/null 2>&1 &")
        run = {"zygotes": [sb._zygote.pid for sb in kept], "inits": [sb.init_pid for sb in kept],
               "bases": [str(sb.storage.base) for sb in kept]}
        print(json.dumps(run), flush=True)
        await kept[0].exec(f"sleep 600.{sys.argv[2]}")
    anyio.run(main)
    """
)


def _survivors(tag: str, run: dict) -> list[str]:
    """Live processes of the killed run: its commands, zygotes, bwraps and sandboxes' inits."""
    from sandbox_contract import live_cmdlines

    found = []
    for pid, cmd in live_cmdlines().items():
        ours = pid in run["zygotes"] or pid in run.get("inits", ())
        if ours or tag in cmd or any(base in cmd for base in run["bases"]):
            found.append(f"{pid}: {cmd[:120]}")
    return found


def test_nothing_of_a_killed_run_survives_and_the_reaper_removes_what_it_left(root, local):
    """The owner is SIGKILLed, and one of its zygotes first: every process of its sandboxes dies
    without anyone's help (a zygote that sees its owner go stops its sandbox; the keeper of a
    sandbox whose zygote is killed exits, and the kernel kills its pid namespace), and `sandbox gc` removes the files."""
    tag = str(os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHER, str(root), tag], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    run = json.loads(proc.stdout.readline())
    deadline = time.time() + 30
    while len(_survivors(tag, {"zygotes": [], "bases": []})) < 2 and time.time() < deadline:
        time.sleep(0.05)  # both sleeps are running

    async def live_one():
        # A sandbox of this (live) process, made through a pool: never reaped.
        pool = SandboxPool(local)
        sb = await pool.create(SandboxSpec())
        assert await reap("local", root_dir=str(root)) == []  # both owners are alive
        return sb

    mine = anyio.run(live_one)
    assert len(_left(root)) == 3
    assert len(_survivors(tag, run)) >= 6  # the two sleeps, the two zygotes, the two sandboxes' inits
    os.kill(run["zygotes"][1], signal.SIGKILL)  # the one holding the background sleep
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while _survivors(tag, run) and time.time() < deadline:  # without any gc
        time.sleep(0.05)
    assert _survivors(tag, run) == []
    r = subprocess.run(
        [sys.executable, "-m", "miles_env.cli.main", "sandbox", "gc", "--provider", "local"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MILES_ENV_SANDBOX_ROOT": str(root)},
    )
    assert r.returncode == 0, r.stderr
    assert "removed 2" in r.stdout, r.stdout
    assert _left(root) == [mine.id] and _survivors(tag, run) == []
    anyio.run(mine.close)
    assert _left(root) == []


_CRASHER_MOUNT = textwrap.dedent(
    """
    import anyio, sys
    from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
    from miles_env.sandboxes.pool import SandboxPool
    from miles_env.types import SandboxSpec
    async def main():
        pool = SandboxPool(LocalSandboxProvider(LocalSandboxConfig(root_dir=sys.argv[1])))
        sb = await pool.create(SandboxSpec(files={"big.txt": "x" * 100000}))
        print(sb.storage.base if sb.storage.mounted else "NOT-MOUNTED", flush=True)
        await sb.exec("sleep 600")
    anyio.run(main)
    """
)


def _mount_points() -> set[str]:
    with open("/proc/self/mounts") as f:
        return {line.split()[1] for line in f}


def test_reaper_unmounts_the_tmpfs_a_killed_run_left(root):
    """As root each sandbox has a tmpfs of its own: the reaper detaches a dead run's, not the next provider."""
    if os.geteuid() != 0:
        pytest.skip("only root mounts a tmpfs per sandbox")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHER_MOUNT, str(root)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    base = proc.stdout.readline().strip()
    if base == "NOT-MOUNTED":
        proc.kill()
        proc.wait()
        pytest.skip("root here may not mount a tmpfs (no CAP_SYS_ADMIN)")
    assert base in _mount_points()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert anyio.run(functools.partial(reap, "local", root_dir=str(root))) == [os.path.basename(base)]
    assert _left(root) == []
    assert base not in _mount_points()  # detached: its RAM is given back now
    assert not os.path.exists(base)


async def test_reaper_removes_orphan_zygote_cgroups_only(local, root):
    from miles_env.sandboxes.local.cgroup import PidsCgroup, pids_base
    from miles_env.sandboxes.local.reaper import reap_local

    if pids_base() is None:
        pytest.skip("no writable pids cgroup here")
    orphan = PidsCgroup.create("miles-env-zorphantest", 8)
    assert orphan is not None
    os.utime(orphan.path, (time.time() - 3600, time.time() - 3600))
    async with await local.create(SandboxSpec()) as sb:
        assert (await sb.exec("true")).ok
        live = sb._cgroup
        assert live is not None
        os.utime(live.path, (time.time() - 3600, time.time() - 3600))
        reap_local(root)
        assert not os.path.exists(orphan.path)  # empty: its zygote is gone
        assert os.path.exists(live.path) and (await sb.exec("echo ok")).stdout == "ok\n"
