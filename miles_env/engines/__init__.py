"""Inference engines behind one contract (see `base.py`).

`EngineConfig` picks a kind and `build_engine(cfg)` returns a ready Engine:
- "hf": the embedded transformers engine (`hf.HFEngine`), the default;
- "sglang": a client of a real SGLang server, or of our embedded server that
  speaks the same native HTTP API (`sglang.SGLangEngine`);
- "scripted": a deterministic engine for tests (`scripted.ScriptedEngine`).
Heavy modules (torch, transformers) are imported only when an engine is built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.errors import ConfigError

__all__ = ["Engine", "EngineConfig", "EngineInfo", "Generation", "SamplingParams", "build_engine"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["hf", "sglang", "scripted"] = "hf"
    model: str = "smollm2"
    url: str | None = None  # sglang: one server
    urls: list[str] = Field(default_factory=list)  # sglang: several servers, sticky by session id
    timeout_s: float = Field(default=600.0, gt=0)  # sglang: per request
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

        urls = ([cfg.url] if cfg.url else []) + list(cfg.urls)
        if not urls:
            raise ConfigError("engine.url: kind 'sglang' needs url or urls")
        return SGLangEngine(urls, timeout_s=cfg.timeout_s)
    import anyio

    from miles_env.engines.scripted import ScriptedEngine  # type: ignore[import-not-found,unused-ignore]
    from miles_env.models import load_tokenizer

    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model)
    if cfg.script is None:
        return ScriptedEngine(tokenizer)  # type: ignore[no-any-return,unused-ignore]
    from miles_env.engines.scripted import load_policy

    policy = load_policy(cfg.script)
    return ScriptedEngine(tokenizer, policy=policy, max_context=cfg.max_context or 1 << 20)  # type: ignore[no-any-return,unused-ignore]
