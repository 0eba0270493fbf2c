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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SamplingParams", "Generation", "EngineInfo", "Engine"]


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
