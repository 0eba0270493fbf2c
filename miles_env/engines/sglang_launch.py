"""How a real SGLang server is launched for `engine.kind=sglang` without `url`/`urls`.

Concept: `launch_sglang(cfg)` runs `python -m sglang.launch_server` (from an SGLang venv at
CACHE/engines/sglang when there is one, else this interpreter) on a free loopback port as a
`ManagedServer` (_launch.py: its own process group, its log under `engine.log_dir`), waits until it
serves, and returns the `SGLangEngine` client (sglang.py) that stops it on `close()`.

Invariant: a run either attaches to servers (`url`/`urls`) or launches one, never both: asking
for both is a ConfigError naming `engine.url`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from miles_env.engines._launch import ManagedServer, ServerSpec, servable_model_dir
from miles_env.engines.configs import SGLangEngineConfig
from miles_env.engines.sglang import SGLangEngine
from miles_env.errors import ConfigError
from miles_env.http import free_port
from miles_env.models import cache_dir, resolve_model

__all__ = ["launch_sglang", "sglang_python"]


def sglang_python() -> Path:
    """The interpreter of an SGLang venv at CACHE/engines/sglang, else this one."""
    venv = cache_dir() / "engines" / "sglang" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


async def launch_sglang(cfg: SGLangEngineConfig) -> SGLangEngine:
    """Start one real SGLang server (`python -m sglang.launch_server`) and return a client of it."""
    if cfg.url or cfg.urls:
        raise ConfigError("engine.url: kind 'sglang' either attaches to url/urls or launches, not both")
    model_dir = servable_model_dir(resolve_model(cfg.model))
    port = cfg.port or free_port()
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="miles-env-sglang-"))
    argv = [
        str(Path(cfg.python) if cfg.python else sglang_python()), "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", cfg.dtype,
    ]  # fmt: skip
    if cfg.max_context:
        argv += ["--context-length", str(cfg.max_context)]
    if cfg.seed is not None:
        argv += ["--random-seed", str(cfg.seed)]
    spec = ServerSpec(
        "sglang", (*argv, *cfg.server_args), f"http://127.0.0.1:{port}", log_dir / f"sglang-{port}.log",
        startup_timeout_s=cfg.startup_timeout_s, nice=cfg.nice,
    )  # fmt: skip
    server = ManagedServer(spec)
    await server.start()
    return SGLangEngine(spec.url, timeout_s=cfg.timeout_s, servers=[server], model_dir=model_dir)
