"""The contract every SandboxProvider must meet, as a reusable test class.

Use: subclass `SandboxContract` in a test module and define a `provider`
fixture returning the provider under test (and an `anyio_backend` fixture):

    class TestLocalContract(SandboxContract):
        @pytest.fixture
        def provider(self): return LocalSandboxProvider()

Behaviours: exit codes, stdout/stderr, stdin, env (spec and per exec), cwd,
timeout, files placed from the spec, write/read round trips, expose() reaching
a real host HTTP server, close idempotent and final; and a container's semantics: one process
space for the sandbox's life (a background process outlives its exec and dies at close, a port
bound in one exec answers the next), a writable root of its own within the disk quota, and the
image's environment (ENV and PATH, USER, the user's HOME, WORKDIR) in every exec unless the call
sets it. For the last, a subclass also defines an `image_spec` fixture: a spec of the image
rootfs_support.IMAGE describes (its ENV, USER app, WORKDIR).

`HostileContract` (subclassed the same way, plus a `host_path` method) is the
escape and exhaustion suite: sysctl writes, root-only host files, setuid-root
files and device nodes, disk filling with many files, a huge host-side read.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rootfs_support import IMAGE, IMAGE_PATH

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox
from miles_env.sandboxes.docker.provider import ROOT_CAPABILITIES
from miles_env.types import Resources, SandboxSpec

__all__ = ["HostileContract", "SandboxContract", "host_http_server", "host_pids_with", "live_cmdlines"]


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
# A server on 127.0.0.1:PORT that answers each connection with "pong", and a client that retries
# for up to 20 s (the server may take a moment to start on a loaded machine).
SERVE = (
    "import socket, sys\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "while True:\n    c, _ = s.accept(); c.sendall(b'pong'); c.close()\n"
)
CONNECT = (
    "import socket, sys, time\nend = time.time() + 20\n"
    "while True:\n    try:\n        print(socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2).recv(9).decode()); break\n"
    "    except OSError:\n        if time.time() > end: raise\n        time.sleep(0.1)\n"
)


def live_cmdlines() -> dict[int, str]:
    """Every live host process but this one and zombies: pid -> its command line, NULs as spaces."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            pass
    return found


def host_pids_with(marker: str) -> list[int]:
    """Live host processes whose command line holds `marker` (a sandbox's, seen from the host)."""
    return [pid for pid, cmd in live_cmdlines().items() if marker in cmd]


@pytest.mark.anyio
class SandboxContract:
    def writable_root(self, provider) -> bool:
        """Whether writes outside the workspace land in the sandbox's own layer here; a provider
        that keeps a read-only root where it cannot cap that layer says so (docker)."""
        return True

    async def _read_only_root(self, sb: Sandbox) -> None:
        """The documented hardening instead of a writable root: such writes fail, nothing lands."""
        r = await sb.exec("echo x > /etc/miles-env-probe")
        assert r.exit_code != 0 and "Read-only" in r.stderr, r

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

    # -- a container's semantics -----------------------------------------------------------------
    async def test_a_background_process_outlives_its_exec_and_dies_at_close(self, provider):
        marker = f"{300 + secrets.randbelow(10**6) / 10**7:.7f}"  # a sleep only this test runs
        sb = await provider.create(SandboxSpec())
        try:
            started = await sb.exec(f"sleep {marker} > /dev/null 2>&1 & echo $!")
            assert started.ok, started
            pid = started.stdout.strip()
            again = await sb.exec(f"kill -0 {pid} && echo alive; ps -o args= -p {pid} 2>/dev/null || true")
            assert again.stdout.startswith("alive\n"), again
            assert host_pids_with(marker) != []
        finally:
            await sb.close()
        assert host_pids_with(marker) == []

    async def test_a_port_bound_in_one_exec_answers_the_next(self, provider):
        async with await provider.create(SandboxSpec(files={"serve.py": SERVE, "connect.py": CONNECT})) as sb:
            started = await sb.exec("nohup python3 serve.py 8123 > /dev/null 2>&1 & echo started")
            assert started.stdout == "started\n", started
            for _ in range(2):  # the agent's next command, then the verifier's
                r = await sb.exec(["python3", "connect.py", "8123"], timeout=30)
                assert r.stdout == "pong\n", r

    async def test_writes_outside_the_workspace_stay_in_the_sandbox(self, provider):
        token = secrets.token_hex(4)
        async with await provider.create(SandboxSpec()) as sb:
            if not self.writable_root(provider):
                return await self._read_only_root(sb)
            made = await sb.exec(
                f"mkdir -p /opt/app-{token} /var/log/app-{token} && echo opt > /opt/app-{token}/f && "
                f"echo etc > /etc/app-{token}.conf && echo log > /var/log/app-{token}/log"
            )
            assert made.ok, made
            r = await sb.exec(f"cat /opt/app-{token}/f /etc/app-{token}.conf /var/log/app-{token}/log")
            assert r.stdout == "opt\netc\nlog\n", r
            # a program built in /tmp runs from there (go test, a compiled test helper), as in a container
            r = await sb.exec("d=$(mktemp -d) && cp /bin/sh $d/t && $d/t -c 'echo ran'")
            assert r.stdout == "ran\n", r
            async with await provider.create(SandboxSpec()) as other:
                assert (await other.exec(f"test -e /etc/app-{token}.conf")).exit_code != 0
        assert not os.path.exists(f"/opt/app-{token}") and not os.path.exists(f"/etc/app-{token}.conf")

    async def test_the_writable_root_is_within_the_disk_quota(self, provider):
        async with await provider.create(SandboxSpec(resources=Resources(disk_mb=8, timeout_s=60))) as sb:
            if not self.writable_root(provider):
                return await self._read_only_root(sb)
            fill = "mkdir -p /opt/fill && for i in $(seq 8); do head -c 2097152 /dev/zero > /opt/fill/f$i || exit 3; done"
            r = await sb.exec(fill)  # 16 MiB into a layer of 8
            used = await sb.exec("du -sk /opt/fill")
            assert r.exit_code == 3 and int(used.stdout.split()[0]) <= 8 * 1024, (r, used)
            freed = await sb.exec("rm -rf /opt/fill && echo x > /opt/small && cat /opt/small")
            assert freed.stdout == "x\n", freed

    async def test_the_image_environment_applies_to_every_exec(self, provider, image_spec):
        async with await provider.create(image_spec) as sb:
            r = await sb.exec('echo "$PATH|$HOME|$GREETING|$(pwd)|$(id -un)|$(id -u)|$(id -G)"; tool')
            want = f"{IMAGE_PATH}|/home/app|from the image|{IMAGE.workdir}|app|1000|1000 50\n"
            assert r.stdout == want + "tool from the image PATH\n", r
            mine = await sb.exec(
                "echo $HOME $GREETING; pwd", env={"HOME": "/tmp", "GREETING": "mine"}, cwd="/tmp"
            )
            assert mine.stdout == "/tmp mine\n/tmp\n", mine  # the caller's keys win
            # The user's own files and HOME are theirs (ssh-keygen writes ~/.ssh); root's are not.
            if not self.writable_root(provider):
                return await self._read_only_root(sb)
            own = await sb.exec(
                "mkdir -p ~/.ssh && echo key > ~/.ssh/id && cat ~/.ssh/id && echo more >> owned.txt"
            )
            assert own.ok and own.stdout == "key\n", own
            assert (await sb.exec("echo x >> /etc/passwd")).exit_code != 0
            caps = await sb.exec(
                "while read -r k v; do case $k in CapPrm:|CapEff:|CapBnd:) echo $k $v;; esac; done < /proc/self/status"
            )
            held = dict(zip(caps.stdout.split()[::2], caps.stdout.split()[1::2], strict=True))
            # none held by a non-root user; the bounding set is the container's on docker (no more than
            # root's), none on local: no exec gets more (the next test: not even a setuid-root one)
            assert held["CapPrm:"] == held["CapEff:"] == "0" * 16, caps
            assert held["CapBnd:"] in (
                "0" * 16,
                f"{_ROOT_MASK:016x}",
            ), caps

    async def test_an_image_setuid_helper_acts_as_in_docker_and_gains_no_more(self, provider, image_spec):
        """A task lets its non-root user reach a root-only file through a setuid-root helper of its
        image (git-bisect-flaky-test's flake-rate): it runs as the sandbox's uid 0, as in Docker,
        with no capability beyond the container's bounding set (local: none; the hostile suite
        below: still no host file, sysctl or device)."""
        async with await provider.create(image_spec) as sb:
            r = await sb.exec("id -u; cat /root/secret; rootcat /root/secret")
            assert r.stdout == "1000\nroot's own\n", r  # app cannot; its helper can
            r = await sb.exec(
                "rootcat /proc/self/status | while read -r k a b c d; do "
                "case $k in Uid:|CapEff:|CapBnd:|NoNewPrivs:) echo $k $a $b;; esac; done"
            )
            status = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
            assert status["Uid:"] == ["1000", "0"] and status["NoNewPrivs:"] == ["0"], r  # real, effective
            bounding = int(status["CapBnd:"][0], 16)
            assert bounding & ~_ROOT_MASK == 0, r  # never beyond Docker's task set
            assert int(status["CapEff:"][0], 16) == bounding, r  # what a setuid-root exec gets: the bound

    async def test_an_exec_runs_as_the_user_it_names(self, provider, image_spec):
        """`exec(user=)` is `docker exec -u` (Harbor's `[verifier] user`): that one exec runs as the
        image's user it names (ids, groups, HOME), the next as the image's USER again; a user the
        image lacks is a SandboxError naming it, never a run as someone else."""
        async with await provider.create(image_spec) as sb:
            r = await sb.exec('echo "$(id -u) $(id -G) $HOME"; cat /root/secret', user="root")
            assert r.stdout == "0 0 /root\nroot's own\n", r
            r = await sb.exec('echo "$(id -u) $(id -G) $HOME"; cat /root/secret', user="nobody")
            assert r.stdout == "65534 65534 /nonexistent\n" and r.exit_code != 0, r
            r = await sb.exec('echo "$(id -u):$(id -g)"', user="1000:50")
            assert r.stdout == "1000:50\n", r
            assert (await sb.exec("id -u")).stdout == "1000\n"  # the image's USER again
            with pytest.raises(SandboxError, match="nobody-here"):
                await sb.exec("true", user="nobody-here")

    async def test_close_idempotent_and_final(self, provider):
        sb = await provider.create(SandboxSpec())
        await sb.exec("true")
        await sb.close()
        await sb.close()
        with pytest.raises(SandboxError):
            await sb.exec("true")


# -- hostile commands every provider must contain ----------------------------------------------

_SYSCTLS = ("kernel/core_pattern", "fs/suid_dumpable", "kernel/core_uses_pid")
# linux/capability.h: the numbers of the capabilities a sandbox's root may hold.
_CAP_NUMBERS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7,
                "NET_BIND_SERVICE": 10}  # fmt: skip
_ROOT_MASK = sum(1 << _CAP_NUMBERS[name] for name in ROOT_CAPABILITIES)  # as /proc/<pid>/status shows it


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

    async def test_root_holds_dockers_task_capabilities_and_no_more(self, provider):
        """Root gets what Docker's default set gives a container's root that tasks use (apt-get's
        drop to `_apt`, chown, port 80), never more, even after exec; mknod stays refused (above)."""
        async with await provider.create(SandboxSpec(files={"f": "x\n"})) as sb:
            r = await sb.exec(
                "while read -r k v; do case $k in CapPrm:|CapEff:|CapBnd:) echo $k $v;; esac; done < /proc/self/status"
            )
            mask = f"{_ROOT_MASK:016x}"
            assert r.stdout.split() == ["CapPrm:", mask, "CapEff:", mask, "CapBnd:", mask], r
            r = await sb.exec(
                "chown 4321:4321 f && stat -c %u f && "
                'python3 -c \'import os, socket; s = socket.socket(); s.bind(("127.0.0.1", 80)); '
                'os.setgid(4321); os.setuid(4321); print(os.getuid(), open("f").read().strip())\''
            )
            assert r.stdout == "4321\n4321 x\n", r

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
