"""Inference engines behind one contract (see `base.py`).

`build_engine(cfg)` returns a ready Engine for the config of one kind (configs.py):
- "hf": the embedded transformers engine (`hf.HFEngine`), the default;
- "sglang": a client of a real SGLang server, or of our embedded server that
  speaks the same native HTTP API (`sglang.SGLangEngine`); `launch: true`
  starts a real SGLang server as a managed subprocess;
- "vllm": a vLLM server's token-in/token-out API (`vllm.VLLMEngine`), launched
  as a managed subprocess from its own venv (scripts/install-vllm.sh) unless
  `url` attaches to a running one;
- "scripted": a deterministic engine for tests (`scripted.ScriptedEngine`).
A kind maps to its builder (builders.py) in ENGINES, the plug-in table; heavy modules
(torch, transformers) are imported only when an engine is built.
"""

from __future__ import annotations

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.engines.configs import (
    EngineConfig,
    HFEngineConfig,
    ScriptedEngineConfig,
    ServerEngineConfig,
    SGLangEngineConfig,
    VLLMEngineConfig,
)
from miles_env.plugins import PluginTable

__all__ = [
    "ENGINES",
    "Engine",
    "EngineConfig",
    "EngineInfo",
    "Generation",
    "HFEngineConfig",
    "SGLangEngineConfig",
    "SamplingParams",
    "ScriptedEngineConfig",
    "ServerEngineConfig",
    "VLLMEngineConfig",
    "build_engine",
]

# kind -> "module:builder"; a builder is `async (its kind's config) -> Engine`
ENGINES = PluginTable(
    "engine kind",
    {
        "hf": "miles_env.engines.builders:build_hf",
        "sglang": "miles_env.engines.builders:build_sglang",
        "vllm": "miles_env.engines.builders:build_vllm",
        "scripted": "miles_env.engines.builders:build_scripted",
    },
)


async def build_engine(cfg: EngineConfig | None = None) -> Engine:
    """Build the engine `cfg` describes (default: hf with smollm2)."""
    cfg = cfg or HFEngineConfig()
    engine: Engine = await ENGINES.load(cfg.kind)(cfg)
    return engine
