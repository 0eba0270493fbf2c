"""A ScriptedEngine behind the embedded SGLang server, in its own process: an engine a test can kill -9.

    python tests/scripted_server.py --port PORT [--reply TEXT] [--delay S]   # prints "ready"

Every reply is `--reply` (default "served by PORT", so a caller can tell which engine answered),
after `--delay` seconds; `cached_tokens` is the scripted engine's per-session prefix cache.
`ScriptedServer` starts one and waits for "ready"; `kill()` is SIGKILL, an engine dying mid-turn.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ScriptedServer"]


class ScriptedServer:
    """One scripted engine server subprocess on `port`."""

    def __init__(self, port: int, *, delay_s: float = 0.0, reply: str | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.reply = reply or f"served by {port}"
        argv = [sys.executable, __file__, "--port", str(port), "--delay", str(delay_s), "--reply", self.reply]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)  # noqa: S603
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip() == "ready":
                return
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"scripted server on port {port} did not start")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


async def _main(port: int, reply: str, delay_s: float) -> None:
    import anyio

    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.engines.sglang_server import create_app
    from miles_env.http import serve_app
    from miles_env.models import load_tokenizer

    engine = ScriptedEngine(load_tokenizer(), default_reply=reply, max_context=65536, delay_s=delay_s)
    engine.record = False
    async with serve_app(create_app(engine), port=port):
        print("ready", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--reply", default="OK")
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args()
    import anyio

    anyio.run(_main, a.port, a.reply, a.delay)
