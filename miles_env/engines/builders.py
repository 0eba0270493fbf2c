"""One builder per engine kind: `async (config) -> Engine`, found by `build_engine` through ENGINES.

Each builder takes its own kind's config (configs.py) and imports its engine module only
when called, so building an sglang client never imports torch. Loading a model runs in a
worker thread. A combination the fields alone cannot refuse (vllm `url` with `launch:
true`) is a ConfigError naming the field.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import anyio

from miles_env.engines.base import Engine
from miles_env.engines.configs import (
    HFEngineConfig,
    ScriptedEngineConfig,
    ServerEngineConfig,
    SGLangEngineConfig,
    VLLMEngineConfig,
)
from miles_env.errors import ConfigError

__all__ = ["build_hf", "build_sglang", "build_vllm", "build_scripted"]


def _log_dir(cfg: ServerEngineConfig, kind: str) -> Path:
    return Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix=f"miles-env-{kind}-"))


def _checkpoint_dtype(model_dir: Path) -> str:
    """'auto' means the checkpoint's dtype, as for hf (vLLM's own 'auto' would pick bf16 on CPU)."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "auto")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _attached_model_dir(cfg: ServerEngineConfig) -> Path | None:
    """The local dir of `cfg.model`, if there is one, for a client attached to a server (EOS ids are
    read there unless the server's own model path is local); nothing is converted or fetched."""
    from miles_env.models import DEFAULT_MODEL, cached_model_dir

    path = cached_model_dir() if cfg.model == DEFAULT_MODEL else Path(cfg.model).expanduser()
    return path if (path / "config.json").is_file() else None


async def build_hf(cfg: HFEngineConfig) -> Engine:
    from miles_env.engines.hf import HFEngine

    return await anyio.to_thread.run_sync(HFEngine, cfg)


async def build_sglang(cfg: SGLangEngineConfig) -> Engine:
    from miles_env.engines.sglang import SGLangEngine
    from miles_env.engines.sglang_launch import launch_sglang

    if cfg.launch:
        if cfg.router != "ring":
            raise ConfigError("engine.router: sglang-router routes between url/urls, not a launched server")
        return await launch_sglang(cfg)
    urls = ([cfg.url] if cfg.url else []) + list(cfg.urls)
    if not urls:
        raise ConfigError("engine.url: kind 'sglang' needs url or urls (or launch: true)")
    if cfg.router == "sglang-router":
        return await _routed_sglang(cfg, urls)
    return SGLangEngine(urls, timeout_s=cfg.timeout_s, model_dir=_attached_model_dir(cfg))


async def _routed_sglang(cfg: SGLangEngineConfig, urls: list[str]) -> Engine:
    """SGLang's router started in front of `urls`; the client posts /generate to it."""
    from miles_env.engines.router import start_router
    from miles_env.engines.sglang import SGLangEngine
    from miles_env.http import free_port

    port = free_port()
    router = await start_router(urls, port, _log_dir(cfg, "sglang") / f"sglang-router-{port}.log")
    return SGLangEngine(
        urls,
        timeout_s=cfg.timeout_s,
        model_dir=_attached_model_dir(cfg),
        router=router.spec.url,
        servers=[router],
    )


async def build_vllm(cfg: VLLMEngineConfig) -> Engine:
    from miles_env.engines._launch import on_a_free_port
    from miles_env.engines.vllm import VLLMEngine
    from miles_env.engines.vllm_launch import vllm_model_dir, vllm_server_spec
    from miles_env.models import resolve_model

    if cfg.url and cfg.launch:
        raise ConfigError(
            "engine.url: kind 'vllm' either attaches to url or launches (launch: true), not both"
        )
    if cfg.url:
        return VLLMEngine(
            cfg.url, model_dir=_attached_model_dir(cfg), timeout_s=cfg.timeout_s, max_restarts=0
        )
    model_dir = resolve_model(cfg.model)
    log_dir = _log_dir(cfg, "vllm")

    async def start(port: int) -> Engine:
        spec = vllm_server_spec(
            vllm_model_dir(model_dir),
            port,
            log_dir / f"vllm-{port}.log",
            python=cfg.python,
            dtype=_checkpoint_dtype(model_dir) if cfg.dtype == "auto" else cfg.dtype,
            max_model_len=cfg.max_context or 2048,
            kv_cache_gb=cfg.kv_cache_gb,
            threads=cfg.threads,
            seed=cfg.seed,
            server_args=cfg.server_args,
            startup_timeout_s=cfg.startup_timeout_s,
            nice=cfg.nice,
        )
        return await VLLMEngine.launch(
            spec, model_dir, timeout_s=cfg.timeout_s, max_restarts=cfg.max_restarts
        )

    return await on_a_free_port(start, cfg.port)


async def build_scripted(cfg: ScriptedEngineConfig) -> Engine:
    from miles_env.engines.scripted import ScriptedEngine, load_policy
    from miles_env.models import load_tokenizer

    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model)
    faults = frozenset(cfg.fail_score_calls)
    if cfg.script is None:  # SmolLM2's 8k unless told (--engine-opt max_context=...)
        return ScriptedEngine(tokenizer, max_context=cfg.max_context or 8192, fail_score_calls=faults)
    policy = load_policy(cfg.script)
    return ScriptedEngine(
        tokenizer, policy=policy, max_context=cfg.max_context or 1 << 20, fail_score_calls=faults
    )
