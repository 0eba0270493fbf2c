"""The contract every SandboxProvider must meet, as a reusable test class.

Use: subclass `SandboxContract` in a test module and define a `provider`
fixture returning the provider under test (and an `anyio_backend` fixture):

    class TestLocalContract(SandboxContract):
        @pytest.fixture
        def provider(self): return LocalSandboxProvider()

Behaviours: exit codes, stdout/stderr, stdin, env (spec and per exec), cwd,
timeout, files placed from the spec, write/read round trips, expose() reaching
a real host HTTP server, close idempotent and final.

`HostileContract` (subclassed the same way, plus a `host_path` method) is the
escape and exhaustion suite: sysctl writes, root-only host files, setuid-root
files and device nodes, disk filling with many files, a huge host-side read.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox
from miles_env.types import Resources, SandboxSpec

__all__ = ["HostileContract", "SandboxContract", "host_http_server"]


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def host_http_server() -> Iterator[int]:
    """A real HTTP server on the host's 127.0.0.1; yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


@pytest.mark.anyio
class SandboxContract:
    async def test_is_a_sandbox(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            assert isinstance(sb, Sandbox)
            assert sb.workdir == "/workspace"

    async def test_exit_codes_and_streams(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            ok = await sb.exec("echo out; echo err >&2")
            assert (ok.exit_code, ok.stdout, ok.stderr, ok.ok) == (0, "out\n", "err\n", True)
            bad = await sb.exec("exit 3")
            assert bad.exit_code == 3 and not bad.ok
            argv = await sb.exec(["printf", "%s|", "a b", "c"])
            assert argv.stdout == "a b|c|"
            killed = await sb.exec("kill -9 $$")
            assert killed.exit_code == -9

    async def test_stdin_env_cwd(self, provider):
        spec = SandboxSpec(env={"FROM_SPEC": "s"})
        async with await provider.create(spec) as sb:
            assert (await sb.exec(["cat"], stdin="piped\n")).stdout == "piped\n"
            assert (await sb.exec(["cat"], stdin=b"\x00bytes")).stdout == "\x00bytes"
            env = await sb.exec('echo "$FROM_SPEC $FROM_EXEC"', env={"FROM_EXEC": "e"})
            assert env.stdout == "s e\n"
            assert (await sb.exec("pwd")).stdout == "/workspace\n"
            await sb.exec("mkdir -p sub/dir")
            assert (await sb.exec("pwd", cwd="sub/dir")).stdout == "/workspace/sub/dir\n"
            assert (await sb.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"

    async def test_timeout(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            r = await sb.exec("echo started; sleep 30", timeout=0.5)
            assert r.timed_out and not r.ok
            assert r.stdout == "started\n"
            assert r.duration_s < 10
            again = await sb.exec("echo alive")
            assert again.stdout == "alive\n"

    async def test_default_timeout_from_resources(self, provider):
        spec = SandboxSpec(resources=Resources(timeout_s=0.5))
        async with await provider.create(spec) as sb:
            assert (await sb.exec("sleep 30")).timed_out

    async def test_files(self, provider):
        spec = SandboxSpec(files={"seed/a.txt": "from spec", "/workspace/b.txt": "abs"})
        async with await provider.create(spec) as sb:
            assert (await sb.exec("cat seed/a.txt b.txt")).stdout == "from specabs"
            await sb.write_file("new/dir/c.bin", b"\x00\xffdata")
            assert await sb.read_file("new/dir/c.bin") == b"\x00\xffdata"
            assert (await sb.exec("wc -c < new/dir/c.bin")).stdout.strip() == "6"
            await sb.exec("echo made inside > inside.txt")
            assert await sb.read_file("/workspace/inside.txt") == b"made inside\n"
            await sb.write_file("a.txt", "text")
            assert await sb.read_file("a.txt") == b"text"
            with pytest.raises(SandboxError):
                await sb.read_file("missing.txt")

    async def test_files_persist_across_execs(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            await sb.exec("echo 1 > /workspace/x; echo 2 > /tmp/y")
            assert (await sb.exec("cat /workspace/x /tmp/y")).stdout == "1\n2\n"

    async def test_a_same_size_edit_in_the_same_second_runs_the_new_code(self, provider):
        # A bytecode cache trusts the source's mtime (whole seconds) and size: with it, the second
        # run below would still print 1 (the agent's correct fix graded as wrong).
        async with await provider.create(SandboxSpec()) as sb:
            await sb.write_file("m.py", "x = 1\n")
            run = "python3 -c 'import m; print(m.x)'"
            script = (
                f"touch -d @1000000000 m.py; {run}; echo 'x = 2' > m.py; touch -d @1000000000 m.py; {run}"
            )
            r = await sb.exec(script)
            assert r.stdout == "1\n2\n", r.stderr

    async def test_expose_reaches_host_http(self, provider, host_http_server):
        async with await provider.create(SandboxSpec()) as sb:
            inner = await sb.expose(f"http://127.0.0.1:{host_http_server}/s/abc/v1")
            assert inner.endswith("/s/abc/v1")
            r = await sb.exec(["python3", "-c", FETCH, inner + "/models"])
            assert r.exit_code == 0, r.stderr
            assert r.stdout == "hello /s/abc/v1/models\n"

    async def test_close_idempotent_and_final(self, provider):
        sb = await provider.create(SandboxSpec())
        await sb.exec("true")
        await sb.close()
        await sb.close()
        with pytest.raises(SandboxError):
            await sb.exec("true")


# -- hostile commands every provider must contain ----------------------------------------------

_SYSCTLS = ("kernel/core_pattern", "fs/suid_dumpable", "kernel/core_uses_pid")


def _host_sysctls() -> dict[str, str]:
    out = {}
    for name in _SYSCTLS:
        try:
            with open(f"/proc/sys/{name}") as f:
                out[name] = f.read()
        except OSError:
            pass
    return out


@pytest.mark.anyio
class HostileContract:
    """Escape and exhaustion attempts (issue 15), run against every provider that isolates.

    A subclass gives `host_path(sb, inner)`: where a file of the sandbox's workspace lives on
    the host (None when it is nowhere on the host), and `quota_shared`: whether /workspace and
    /tmp share one `disk_mb` quota (else each has its own, so twice that in all).
    """

    quota_shared = True

    def host_path(self, sb: Sandbox, inner: str) -> Path | None:
        raise NotImplementedError

    def quota_missing(self, sb: Sandbox) -> str | None:
        """Why sandbox `sb` has no total disk quota here (then that test skips), or None."""
        return None

    async def test_sysctl_writes_fail_and_leave_the_host_unchanged(self, provider):
        before = _host_sysctls()
        async with await provider.create(SandboxSpec()) as sb:
            for name in _SYSCTLS:  # the value it already has: harmless even where the write lands
                r = await sb.exec(f"v=$(cat /proc/sys/{name}) && printf '%s\\n' \"$v\" > /proc/sys/{name}")
                assert r.exit_code != 0, (name, r)
            r = await sb.exec("echo 1 > /proc/sys/vm/drop_caches")
            assert r.exit_code != 0, r
            # Never written, only probed: access(W_OK) answers for a read-only mount too.
            r = await sb.exec("test -e /proc/sysrq-trigger && test -w /proc/sysrq-trigger && echo WRITABLE")
            assert "WRITABLE" not in r.stdout
            r = await sb.exec("test -e /proc/kcore && head -c 1 /proc/kcore > /dev/null && echo READ")
            assert "READ" not in r.stdout
            r = await sb.exec("grep -E ' /proc/sys ' /proc/self/mounts || true")
            assert r.stdout == "" or " ro," in r.stdout, r.stdout  # bound read-only where bound
        assert _host_sysctls() == before

    async def test_root_only_host_files_stay_unreadable(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            r = await sb.exec("cat /etc/shadow /etc/gshadow")
            assert r.exit_code != 0 and ":" not in r.stdout, r
            r = await sb.exec("ls /root")
            assert r.exit_code != 0 or r.stdout == "", r

    async def test_no_setuid_root_file_or_device_node_reaches_the_host(self, provider):
        async with await provider.create(SandboxSpec(files={"given": "#!/bin/sh\nid\n"})) as sb:
            await sb.exec("cp /bin/sh sush; chown 0:0 sush given; chmod u+s,g+s sush given")
            mk = await sb.exec("mknod null2 c 1 3")
            assert mk.exit_code != 0, mk
            for name in ("sush", "given"):
                host = self.host_path(sb, name)
                if host is None:
                    continue
                st = os.lstat(host)
                setuid_root = bool(st.st_mode & stat.S_ISUID) and st.st_uid == 0
                nosuid = bool(os.statvfs(host).f_flag & os.ST_NOSUID)
                assert not setuid_root or nosuid, (name, oct(st.st_mode), st.st_uid)

    async def test_many_small_files_stay_within_disk_mb(self, provider):
        spec = SandboxSpec(resources=Resources(disk_mb=4, timeout_s=60))
        async with await provider.create(spec) as sb:
            if (why := self.quota_missing(sb)) is not None:
                pytest.skip(why)
            fill = (
                "for d in /workspace /tmp; do for i in $(seq 40); do "
                "head -c 262144 /dev/zero > $d/f$i || break; done; done; du -sk /workspace /tmp"
            )
            r = await sb.exec(fill)
            total_kb = sum(int(line.split()[0]) for line in r.stdout.splitlines())
            budget_kb = 4 * 1024 * (1 if self.quota_shared else 2)
            assert total_kb <= budget_kb, (total_kb, r)  # 40 x 256 KiB x 2 were attempted
            assert r.exit_code != 0 or "No space" in r.stderr
            await sb.exec("rm -f /workspace/f* /tmp/f*")
            empty = "import os\nn = 0\ntry:\n    for n in range(100000): open(f'e{n}', 'w').close()\nexcept OSError: pass\nprint(n)"
            r = await sb.exec(["python3", "-c", empty])
            assert int(r.stdout) < 100000 - 1, r  # the inode cap ends it: kernel memory stays bounded
            assert (await sb.exec("echo alive")).ok

    async def test_a_huge_file_is_refused_by_read_file(self, provider):
        import tracemalloc

        async with await provider.create(SandboxSpec()) as sb:
            r = await sb.exec("truncate -s 200M big && echo small > small")
            assert r.ok, r
            tracemalloc.start()
            try:
                with pytest.raises(SandboxError, match="bytes"):
                    await sb.read_file("big")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 32 << 20, peak  # never read whole
            assert await sb.read_file("small") == b"small\n"
