"""The contract every SandboxProvider must meet, as a reusable test class.

Use: subclass `SandboxContract` in a test module and define a `provider`
fixture returning the provider under test (and an `anyio_backend` fixture):

    class TestLocalContract(SandboxContract):
        @pytest.fixture
        def provider(self): return LocalSandboxProvider()

Behaviours: exit codes, stdout/stderr, stdin, env (spec and per exec), cwd,
timeout, files placed from the spec, write/read round trips, expose() reaching
a real host HTTP server, close idempotent and final.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox
from miles_env.types import Resources, SandboxSpec

__all__ = ["SandboxContract", "host_http_server"]


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
