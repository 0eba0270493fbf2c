"""The servers of bench/bench_tito.py's proxy comparison, each a subprocess on a loopback port.

- `fake_engine`: bench/fake_engine.py (SGLang native API + a minimal /v1/chat/completions).
- `tito_proxy`: `miles-env proxy serve --engine sglang` on that engine, as a user would run it.
- `litellm_proxy`: LiteLLM's proxy server from its own venv (`bash scripts/install-litellm.sh`,
  pinned there), so it never touches this environment's packages, routing model MODEL to the
  engine's OpenAI-compatible URL. Offline: the bundled model cost map, no database (so no spend
  logs), no telemetry, logs at ERROR. LiteLLM refuses to start without a master key; the client
  sends it as a bearer token.

Each context manager yields the server's base URL once its health route answers, and
terminates the process (by its pid) on exit.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from miles_env.http import free_port
from miles_env.models import cache_dir

MODEL = "bench"  # the model name the client asks LiteLLM for
ADMIN_TOKEN = "bench-admin-" + secrets.token_hex(8)
LITELLM_KEY = "sk-bench-" + secrets.token_hex(16)
HERE = Path(__file__).resolve().parent

LITELLM_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {api_base}
      api_key: none
litellm_settings:
  telemetry: false
  set_verbose: false
  drop_params: true
"""


@contextmanager
def running(cmd: list[str], health: str, log: Path, env: Mapping[str, str] | None = None,
            startup_s: float = 120) -> Iterator[None]:  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(health, timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[0]} did not come up in {startup_s} s; see {log}")
                time.sleep(0.2)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def fake_engine(workdir: Path, echo: int) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, str(HERE / "fake_engine.py"), "--port", str(port), "--echo", str(echo)]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, f"{url}/health", workdir / "engine.log"):
        yield url


@contextmanager
def tito_proxy(workdir: Path, engine_url: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "miles_env.cli.main", "proxy", "serve", "--engine", "sglang",
           "--url", engine_url, "--port", str(port), "--store", str(workdir / "sessions"),
           "--admin-token", ADMIN_TOKEN]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(cmd, f"{url}/health", workdir / "tito.log"):
        yield url


def litellm_exe() -> Path:
    return cache_dir() / "bench" / "litellm" / "bin" / "litellm"


def litellm_version() -> str:
    py = litellm_exe().parent / "python"
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def litellm_proxy(workdir: Path, engine_url: str) -> Iterator[str]:
    exe = litellm_exe()
    if not exe.exists():
        raise SystemExit(f"LiteLLM is not installed at {exe}: run `bash scripts/install-litellm.sh`")
    cfg = workdir / "litellm.yaml"
    cfg.write_text(LITELLM_CONFIG.format(model=MODEL, api_base=f"{engine_url}/v1"))
    env = os.environ | {
        "LITELLM_MASTER_KEY": LITELLM_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_MODE": "PRODUCTION",  # do not read a .env file
        "NO_DOCS": "True",
    }
    port = free_port()
    cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, f"{url}/health/liveliness", workdir / "litellm.log", env):
        yield url
