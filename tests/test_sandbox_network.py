"""Network 'public' on the local provider: slirp4netns's outbound network, never the host's loopback,
gone with its sandbox; and how a Harbor task's `allow_internet` reaches it.

Every packet these tests send goes to this machine (the workplace's rule): servers bound on the
host's own non-loopback address and on its 127.0.0.1. That an outside host answers is checked by
hand (docs/sandboxes.md), never here.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
from harbor_support import make_task

from miles_env.adapters.harbor.taskdir import read_task_dir
from miles_env.errors import ConfigError
from miles_env.limits import LimitsOverride, effective_spec
from miles_env.sandboxes.docker.provider import DockerSandboxProvider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.pool import reap
from miles_env.types import NetworkPolicy, SandboxSpec

pytestmark = pytest.mark.anyio
needs_slirp = pytest.mark.skipif(
    shutil.which("slirp4netns") is None,
    reason="slirp4netns is not installed (bash scripts/install-system.sh)",
)
PUBLIC = SandboxSpec(network=NetworkPolicy.PUBLIC)
# Connects to argv[1]:argv[2] over TCP (prints what the server sends) or, with argv[3] == "udp",
# sends a datagram and prints the answer; prints "ERR <errno name>" when it cannot.
CLIENT = textwrap.dedent(
    """
    import errno, socket, sys
    host, port, proto = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    try:
        if proto == "tcp":
            print(socket.create_connection((host, port), 3).recv(16).decode())
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
            s.sendto(b"ping", (host, port)); print(s.recv(16).decode())
    except OSError as e:
        print("ERR", errno.errorcode.get(e.errno, e.errno) if e.errno else type(e).__name__)
    """
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def provider(tmp_path) -> LocalSandboxProvider:
    return LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "sandboxes"), warm=0))


def _host_address() -> str:
    """This host's own non-loopback IPv4 address: the source of its route out (a UDP connect looks
    the route up and sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("no IPv4 route out of this host")
        addr = s.getsockname()[0]
    if addr.startswith("127.") or addr.startswith("10.0.2."):  # loopback, or slirp4netns's own net
        pytest.skip(f"this host's address {addr} cannot tell the host's loopback from its network")
    return addr


def _serve(addr: str, proto: str = "tcp") -> int:
    """A server on addr (TCP: answers "pong" to each connection; UDP: echoes "pong"); its port."""
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    s = socket.socket(socket.AF_INET, kind)
    s.bind((addr, 0))

    def run() -> None:
        while True:
            if proto == "tcp":
                conn, _ = s.accept()
                conn.sendall(b"pong")
                conn.close()
            else:
                _, peer = s.recvfrom(16)
                s.sendto(b"pong", peer)

    if proto == "tcp":
        s.listen()
    threading.Thread(target=run, daemon=True).start()
    return s.getsockname()[1]


async def _reach(sb, host: str, port: int, proto: str = "tcp") -> str:
    r = await sb.exec(["python3", "-c", CLIENT, host, str(port), proto], timeout=20)
    return r.stdout.strip()


def _slirps_of(zygote_pid: int) -> list[int]:
    """Live slirp4netns processes forked by the zygote `zygote_pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
            except OSError:
                continue
            if status["Name"].strip() == "slirp4netns" and int(status["PPid"]) == zygote_pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """pid is a live (not zombie) slirp4netns."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            comm, rest = f.read().rsplit(")", 1)
    except OSError:
        return False
    return comm.endswith("(slirp4netns") and rest.split()[0] != "Z"


@needs_slirp
async def test_a_sandbox_with_network_reaches_the_host_and_one_without_does_not(provider):
    addr = _host_address()
    tcp, udp = _serve(addr), _serve(addr, "udp")
    async with await provider.create(PUBLIC) as sb:
        devices = (await sb.exec("cat /proc/net/dev")).stdout.splitlines()[2:]
        assert sorted(line.split(":")[0].strip() for line in devices) == ["eth0", "lo"]
        assert (await sb.exec("cat /etc/resolv.conf")).stdout == "nameserver 10.0.2.3\n"
        assert await _reach(sb, addr, tcp) == "pong"
        assert await _reach(sb, addr, udp, "udp") == "pong"
    async with await provider.create(SandboxSpec()) as sb:
        assert await _reach(sb, addr, tcp) == "ERR ENETUNREACH"


@needs_slirp
async def test_a_sandbox_with_network_cannot_reach_the_host_loopback(provider):
    """The host's 127.0.0.1 services (TITO proxy, Redis, registry) stay out of reach: not through
    slirp4netns's gateway 10.0.2.2 (which would map to it without --disable-host-loopback), not at
    the host's own address (bound to loopback only), not at the sandbox's own 127.0.0.1."""
    port = _serve("127.0.0.1")
    async with await provider.create(PUBLIC) as sb:
        assert await _reach(sb, "10.0.2.2", port) == "ERR ENETUNREACH"
        assert await _reach(sb, _host_address(), port) == "ERR ECONNREFUSED"
        assert await _reach(sb, "127.0.0.1", port) == "ERR ECONNREFUSED"
        # expose() still bridges the one endpoint it is given, as without network.
        inner = await sb.expose(f"http://127.0.0.1:{port}/")
        assert await _reach(sb, "127.0.0.1", int(inner.rsplit(":", 1)[1].strip("/"))) == "pong"


@needs_slirp
async def test_the_network_helper_is_gone_after_close(provider):
    sb = await provider.create(PUBLIC)
    (slirp,) = _slirps_of(sb._zygote.pid)
    if sb._cgroup is not None:  # forked by the zygote: counted in the sandbox's cgroup, beside it
        assert slirp in sb._cgroup.pids()
    await sb.close()
    assert not _alive(slirp)


_CRASHER = textwrap.dedent(
    """
    import anyio, json, sys
    from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
    from miles_env.sandboxes.pool import SandboxPool
    from miles_env.types import NetworkPolicy, SandboxSpec
    async def main():
        pool = SandboxPool(LocalSandboxProvider(LocalSandboxConfig(root_dir=sys.argv[1])))
        kept = [await pool.create(SandboxSpec(network=NetworkPolicy.PUBLIC)) for _ in range(2)]
        print(json.dumps([sb._zygote.pid for sb in kept]), flush=True)
        await kept[0].exec("sleep 600")
    anyio.run(main)
    """
)


@needs_slirp
def test_nothing_of_the_network_survives_a_killed_owner_or_zygote(tmp_path: Path) -> None:
    """One zygote SIGKILLed (its slirp4netns sees EOF on its exit fd, and has PDEATHSIG), then the
    owner (its other zygote sees EOF and stops its sandbox): no slirp4netns is left."""
    root = tmp_path / "sandboxes"
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        zygotes = json.loads(proc.stdout.readline())
        slirps = [pid for z in zygotes for pid in _slirps_of(z)]
        assert len(slirps) == 2, slirps
        os.kill(zygotes[1], signal.SIGKILL)
        deadline = time.time() + 10
        while _alive(slirps[1]) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(slirps[1]), "slirp4netns outlived its zygote"
    finally:  # the owner's SIGKILL, also when a check above failed (then its zygotes end the rest)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 15
    while any(map(_alive, slirps)) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, slirps)), "slirp4netns outlived its owner"
    assert len(anyio.run(functools.partial(reap, "local", root_dir=str(root)))) == 2  # the files, as ever
    assert list(root.iterdir()) == []


@needs_slirp
async def test_a_harbor_task_with_allow_internet_gets_the_network_unless_the_run_forbids_it(
    provider, tmp_path
):
    d = make_task(tmp_path)
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace("[environment]\n", "[environment]\nallow_internet = true\n"))
    task = read_task_dir(d, "harbor")
    assert task.sandbox.network is NetworkPolicy.PUBLIC and task.metadata["harbor"]["allow_internet"]
    forbidden = effective_spec(task.sandbox, LimitsOverride.model_validate({"network": "none"}))
    assert forbidden.network is NetworkPolicy.NONE
    assert effective_spec(task.sandbox, LimitsOverride(network=NetworkPolicy.HOST)) == task.sandbox  # looser
    for spec, devices in ((task.sandbox, ["eth0", "lo"]), (forbidden, ["lo"])):
        async with await provider.create(spec) as sb:  # the task's spec (its image aside) on local
            lines = (await sb.exec("cat /proc/net/dev")).stdout.splitlines()[2:]
            assert sorted(line.split(":")[0].strip() for line in lines) == devices


async def test_network_policies_map_consistently_across_providers(provider) -> None:
    """`host` is the host's own network namespace: docker only (local refuses it); `public` is an
    outbound network that is not the host's: docker's bridge, refused where the engine has none;
    a run's `public` ceiling turns a task's `host` into `public`."""
    assert effective_spec(SandboxSpec(network="host"), LimitsOverride(network="public")).network == "public"
    with pytest.raises(ConfigError, match="network='host'"):
        await provider.create(SandboxSpec(network=NetworkPolicy.HOST))

    def docker(bridges: list[str]) -> SimpleNamespace:
        client = SimpleNamespace(
            networks=SimpleNamespace(list=lambda names: [n for n in bridges if n in names])
        )
        return SimpleNamespace(has_bridge=None, client=client)

    mode = DockerSandboxProvider._network_mode
    assert [mode(docker(["bridge"]), p) for p in NetworkPolicy] == ["none", "bridge", "host"]  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no `bridge` network"):
        mode(docker([]), NetworkPolicy.PUBLIC)  # type: ignore[arg-type]
