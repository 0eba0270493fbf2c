"""The Engine contract: token ids in, token ids and logprobs out.

An engine knows nothing of chat, tools or sessions beyond an optional
`session_id` hint used for KV-prefix reuse and sticky routing. Every Generation
carries the weight version that produced it.

Context: `EngineInfo.max_context` is the most prompt + max_new_tokens one request
may ask for on this engine (SGLang: its context length - 1, as it refuses a total
equal to it). A request within it is served; a larger max_new_tokens is clamped
(the generation ends within the limit, finish "length"); a prompt that leaves no
room for one token raises `EngineRefused(reason="context_length")`. Every
deterministic refusal is an EngineRefused, every transient failure a plain
EngineError. `eos_token_ids` are the model directory's. tests/test_engine_contract.py
checks all of this against every engine.

Scoring: an engine that can prefill without sampling (`PromptScorer`: hf, sglang, vllm,
scripted) returns `score(sequences)`, for each sequence the logprob of every token given the ones
before it, `log_softmax(logits)` at temperature 1 (the model's own distribution), position 0 is
0.0 (nothing predicts it). A teacher of on-policy distillation is such an engine (miles_env/opd.py).

Prefix cache: `Generation.cached_tokens` is the prompt tokens served from a reused KV prefix
(SGLang's `meta_info.cached_tokens`); an engine that counts them (`PrefixCacheCounter`) sums
them into `PrefixCacheStats`, and the difference of two readings is a step's hit rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

__all__ = [
    "SamplingParams",
    "Generation",
    "EngineInfo",
    "Engine",
    "InProcessWeights",
    "PrefixCacheStats",
    "PrefixCacheCounter",
    "PromptScorer",
    "ServerSync",
    "PerServerSync",
]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 = off
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, checked on decoded text
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    output_ids: list[int]
    logprobs: list[float]  # logprob of each output id under the sampling distribution's model
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from a reused KV prefix
    latency_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    name: str  # "hf" | "sglang" | "vllm" | "scripted"
    model: str  # path or id
    weight_version: int
    max_context: int  # the most prompt + max_new_tokens one request may ask for (module docstring)
    eos_token_ids: tuple[int, ...] = ()


@runtime_checkable
class Engine(Protocol):
    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation: ...

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        """Load safetensors weights from `path`; return the new weight version."""
        ...

    async def info(self) -> EngineInfo: ...

    async def close(self) -> None: ...


@runtime_checkable
class InProcessWeights(Protocol):
    """Optional capability of an engine in the trainer's process (hf): it takes the trainer's
    tensors as they are, or a `WeightDelta` of them, with no file in between. A remote engine
    (vllm, sglang) lacks it and is synced through `update_weights_from_disk`."""

    model: torch.nn.Module  # its dtype is the one a delta is computed in

    async def update_weights(
        self, state_dict: Mapping[str, Any], weight_version: int | None = None
    ) -> int: ...

    async def apply_weight_delta(self, delta: Any) -> int: ...

    async def apply_weight_delta_from_disk(self, path: str | Path) -> int: ...


@runtime_checkable
class PromptScorer(Protocol):
    """Optional capability: a prefill-only call with prompt logprobs (module docstring, Scoring).
    `score(sequences)[i][t]` is log p(sequences[i][t] | sequences[i][:t]) at temperature 1, and
    `[i][0]` is 0.0; a batch of sequences goes in one call (the engine batches it)."""

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]: ...


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """An engine's prefix-cache counters since it started (or a difference of two readings)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those served from a reused KV prefix

    def add(self, gen: Generation) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.requests + 1, self.prompt_tokens + gen.prompt_len, self.cached_tokens + gen.cached_tokens
        )

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.requests - other.requests,
            self.prompt_tokens - other.prompt_tokens,
            self.cached_tokens - other.cached_tokens,
        )

    @property
    def hit_rate(self) -> float:
        """cached / prompt tokens (SGLang's cache hit rate); 0.0 when no prompt token was asked for."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "prefix_cache_hit_rate": self.hit_rate,
            "prefix_cache_prompt_tokens": float(self.prompt_tokens),
            "prefix_cache_cached_tokens": float(self.cached_tokens),
            "prefix_cache_requests": float(self.requests),
        }


@runtime_checkable
class PrefixCacheCounter(Protocol):
    """Optional capability: the engine sums each Generation's `cached_tokens` (hf, sglang, vllm,
    scripted). A job reads it once per step and logs `(now - before).metrics()`."""

    def prefix_cache_stats(self) -> PrefixCacheStats: ...


@dataclass(frozen=True, slots=True)
class ServerSync:
    """One server's part of the last weight update: its URL and the seconds its load took."""

    url: str
    seconds: float


@runtime_checkable
class PerServerSync(Protocol):
    """Optional capability of an engine over several servers (sglang): the last weight update, timed
    per server (all of them updated in parallel). A job logs them as `sync_s_engine{i}`."""

    def last_sync(self) -> tuple[ServerSync, ...]: ...
