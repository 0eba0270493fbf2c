"""The embedded engine: a transformers causal LM behind the Engine contract.

Concept: `HFEngine` loads the model and its tokenizer, checks every request on the caller's side
(an impossible one is an EngineRefused before it is queued) and hands requests and commands
(weight updates, adapters, flush, score, close) to one worker thread, `_scheduler.Scheduler`,
which owns the model from then on: continuous batching, chunked prefill, per-session and
shared-prompt KV reuse. `generate()` (any asyncio loop, any thread) enqueues a request and awaits
its future; callers must run on asyncio (results come back through `loop.call_soon_threadsafe`);
the engine works across event loops.

Invariants: every Generation was sampled under one weight version. A weight
update stops admission, waits for the running rows to finish (drain), swaps
the tensors, flushes every cached KV, bumps the version and resumes; requests
that arrive meanwhile wait and run under the new weights (the scheduler's rule).

Lifecycle: `HFEngine(cfg)` loads the model and starts the worker (blocking,
seconds; `build_engine` runs it in a thread); `close()` fails pending requests
with EngineError and joins the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from miles_env.engines._batch import Batch
from miles_env.engines._kv import SessionStore
from miles_env.engines._scheduler import Command, CommandKind, Request, Scheduler
from miles_env.engines._weights import load_safetensors, read_lora_adapter
from miles_env.engines.base import EngineInfo, Generation, PrefixCacheStats, SamplingParams
from miles_env.engines.configs import HFEngineConfig
from miles_env.errors import ConfigError, EngineError, EngineRefused

__all__ = ["HFEngineConfig", "HFEngine", "load_safetensors"]

_CONTEXT_CAP = 8192


class HFEngine:
    """transformers engine with continuous batching, session KV reuse and in-place weight updates."""

    name = "hf"

    def __init__(self, config: HFEngineConfig | None = None) -> None:
        self.config = cfg = config or HFEngineConfig()
        self._load()
        self._closed = False
        self.sessions = SessionStore(cfg.kv_cache_tokens, cfg.kv_cache_sessions)
        self._cache = PrefixCacheStats()  # summed cached_tokens of the generations returned
        self._worker = Scheduler(
            self._batch,
            self.sessions,
            threads=self.threads,
            max_batch_size=cfg.max_batch_size,
            prefill_chunk_tokens=cfg.prefill_chunk_tokens,
            max_context=self.max_context,
        )
        self._worker.start()

    @property
    def weight_version(self) -> int:
        """The version of the weights the worker serves now (it alone changes it)."""
        return self._worker.weight_version

    # ---- loading -------------------------------------------------------------------------------
    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from miles_env.models import resolve_model

        cfg = self.config
        self.threads = cfg.threads if cfg.threads is not None else max(1, (os.cpu_count() or 2) // 2)
        self.model_path = resolve_model(cfg.model)
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype: Any = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=dtype)
        except Exception as e:
            raise ConfigError(f"model {str(self.model_path)!r}: cannot load with transformers: {e}") from e
        model.to(self.device).eval()
        model.requires_grad_(False)
        self.model = model
        self._param_names = frozenset(model.state_dict())
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        positions = int(getattr(model.config, "max_position_embeddings", _CONTEXT_CAP) or _CONTEXT_CAP)
        self.max_context = cfg.max_context or min(positions, _CONTEXT_CAP)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = self._eos_ids()
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._batch = Batch(model, self.device, cache_kw, self.tokenizer, self.eos_token_ids, cfg.seed)

    def _eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return tuple(sorted(ids))

    # ---- public API ----------------------------------------------------------------------------
    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        ids = self._validate(input_ids)
        loop = asyncio.get_running_loop()
        req = Request(ids, sampling, session_id, loop, loop.create_future())
        self._submit(req)
        try:
            result: Generation = await req.future
        except asyncio.CancelledError:
            req.cancelled = True  # the worker drops the row at its next step
            raise
        self._cache = self._cache.add(result)
        return result

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._cache

    async def update_weights(
        self,
        state_dict: Mapping[str, Any],
        weight_version: int | None = None,
        *,
        abort_in_flight: bool = False,
    ) -> int:
        """Copy `state_dict` (full or partial) into the model; return the new weight version.

        By default the update waits for the running generations to finish (they keep the old
        version); requests that arrive meanwhile run after it. With `abort_in_flight` the running
        generations end at once with finish_reason "abort" and their partial, old-version output.
        """
        return int(
            await self._command(
                "update",
                state_dict=state_dict,
                weight_version=weight_version,
                abort_in_flight=abort_in_flight,
            )
        )

    async def update_weights_from_disk(
        self, path: str | Path, weight_version: int | None = None, *, abort_in_flight: bool = False
    ) -> int:
        """Load a .safetensors file or a directory of them (an HF checkpoint dir) in place; a MoE
        checkpoint's per-expert tensors are stacked into the model's fused ones (weight_layout.py)."""
        from miles_env.weight_layout import to_model

        state = await anyio.to_thread.run_sync(load_safetensors, path)
        try:
            state = to_model(state, self._param_names)
        except ValueError as e:
            raise EngineError(f"update_weights_from_disk {str(path)!r}: {e}") from e
        return await self.update_weights(state, weight_version, abort_in_flight=abort_in_flight)

    async def apply_weight_delta(self, delta: Any, *, abort_in_flight: bool = False) -> int:
        """Apply a `WeightDelta` (miles_env.trainer.weight_delta) taking `delta.base_version` to
        `delta.new_version`; a corrupted, partial or wrong-base delta raises EngineError and leaves the
        weights and the version unchanged (a full update_weights repairs)."""
        return int(
            await self._command(
                "update", state_dict=delta, weight_version=delta.new_version, abort_in_flight=abort_in_flight
            )
        )

    async def apply_weight_delta_from_disk(self, path: str | Path, *, abort_in_flight: bool = False) -> int:
        """Load a delta file written by `save_delta` and apply it (see apply_weight_delta)."""
        from miles_env.trainer.weight_delta import DeltaError, load_delta

        try:
            delta = await anyio.to_thread.run_sync(load_delta, path)
        except DeltaError as e:
            raise EngineError(f"apply_weight_delta refused: {e}") from e
        return await self.apply_weight_delta(delta, abort_in_flight=abort_in_flight)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """PromptScorer: every token's logprob given the ones before it (base.py), batched; run by
        the worker between decode steps, so it never sees half-updated weights."""
        rows = [self._validate(s) for s in sequences if len(s)]
        if not rows:
            return [[] for _ in sequences]
        scored = iter(await self._command("score", sequences=rows))
        return [next(scored) if len(s) else [] for s in sequences]

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | Path, weight_version: int | None = None
    ) -> int:
        """Serve the PEFT adapter dir `lora_path` on top of the base weights, unmerged (the first one
        injects LoRA layers in place, later ones copy their tensors): an update like any other, so it
        drains the running rows, flushes the KV cache and sets the weight version."""
        adapter = await anyio.to_thread.run_sync(read_lora_adapter, lora_name, lora_path)
        return int(await self._command("update", state_dict=adapter, weight_version=weight_version))

    async def flush_cache(self) -> None:
        """Drop every cached session KV prefix (running requests keep theirs)."""
        await self._command("flush")

    async def info(self) -> EngineInfo:
        return EngineInfo(
            name="hf",
            model=str(self.model_path),
            weight_version=self.weight_version,
            max_context=self.max_context,
            eos_token_ids=self.eos_token_ids,
        )

    async def close(self) -> None:
        if self._closed:
            return
        thread = self._worker.thread
        if thread.is_alive():
            await self._command("close")
            self._closed = True  # from here on nothing is accepted
            await anyio.to_thread.run_sync(thread.join)
        self._closed = True
        self._worker.fail_all(
            EngineError("hf engine closed")
        )  # anything that slipped in after the worker's last look

    # ---- caller side helpers -------------------------------------------------------------------
    def _validate(self, input_ids: Sequence[int]) -> list[int]:
        """A request that can never succeed is an EngineRefused (the others fail transiently)."""
        ids = [int(i) for i in input_ids]
        if not ids:
            raise EngineRefused("generate: input_ids is empty", "invalid_request")
        if len(ids) >= self.max_context:
            raise EngineRefused(
                f"generate: prompt of {len(ids)} tokens does not fit the context of {self.max_context} "
                "tokens (it must leave room for at least one generated token)",
                "context_length",
                prompt_tokens=len(ids),
                limit=self.max_context,
            )
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise EngineRefused(
                f"generate: input_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                "invalid_request",
            )
        return ids

    def _submit(self, item: Request | Command) -> None:
        dead = self._worker.dead
        if self._closed or not self._worker.thread.is_alive():
            raise EngineError(f"hf engine is closed{f' (worker died: {dead!r})' if dead else ''}")
        self._worker.inbox.put(item)

    async def _command(self, kind: CommandKind, **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        cmd = Command(kind, loop, loop.create_future(), **kw)
        self._submit(cmd)
        return await cmd.future
