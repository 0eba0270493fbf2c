"""The embedded engine: a transformers causal LM behind the Engine contract.

Concept: one worker thread owns the model and runs a continuous-batching loop.
`generate()` (any asyncio loop, any thread) enqueues a request and awaits a
future. The worker prefills each new request alone (reusing its session's KV
prefix when the new ids extend it), then lets it join the running decode batch
at a step boundary; a decode step feeds one token per row of a left-padded
batch. Finished rows leave the batch and their KV becomes the session's
cached prefix; a cold prompt's KV is kept too, so any request starting with
the same ids (GRPO siblings, a shared system prompt) skips that part (LRU,
token budget). Callers must run on asyncio (results come back through
`loop.call_soon_threadsafe`); the engine works across event loops.

Invariants: every Generation was sampled under one weight version. A weight
update stops admission, waits for the running rows to finish (drain), swaps
the tensors, flushes every cached KV, bumps the version and resumes; requests
that arrive meanwhile wait and run under the new weights.

Lifecycle: `HFEngine(cfg)` loads the model and starts the worker (blocking,
seconds; `build_engine` runs it in a thread); `close()` fails pending requests
with EngineError and joins the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio

from miles_env.engines._batch import Batch, Row
from miles_env.engines._kv import SessionEntry, SessionStore
from miles_env.engines._score import score_sequences
from miles_env.engines._weights import apply_update, load_safetensors, read_lora_adapter
from miles_env.engines.base import EngineInfo, Generation, PrefixCacheStats, SamplingParams
from miles_env.engines.configs import HFEngineConfig
from miles_env.errors import ConfigError, EngineError, EngineRefused

__all__ = ["HFEngineConfig", "HFEngine", "load_safetensors"]

_CONTEXT_CAP = 8192
_SHARE_MIN_TOKENS = 32  # a prompt prefilled with at least this many uncached tokens is shared
_SCORE_TOKENS = 2048  # padded tokens per scoring forward pass (its float32 logits are tokens x vocab)


@dataclass(slots=True, eq=False)
class _Request:
    input_ids: list[int]
    params: SamplingParams
    session_id: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    t0: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    cancelled: bool = False


@dataclass(slots=True, eq=False)
class _Command:
    kind: Literal["update", "flush", "close", "score"]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    state_dict: Any = None  # a (partial) state dict, a WeightDelta or a LoraAdapter
    weight_version: int | None = None
    abort_in_flight: bool = False
    sequences: list[list[int]] | None = None  # score: the sequences to score


def _resolve(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any, exc: BaseException | None
) -> None:
    def _set() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


class HFEngine:
    """transformers engine with continuous batching, session KV reuse and in-place weight updates."""

    name = "hf"

    def __init__(self, config: HFEngineConfig | None = None) -> None:
        self.config = config or HFEngineConfig()
        self._load()
        self.weight_version = 0
        self._inbox: queue.SimpleQueue[_Request | _Command] = queue.SimpleQueue()
        self._waiting: deque[_Request] = deque()
        self._prefilling: deque[Row] = deque()
        self._pending: list[_Command] = []
        self._closed = False
        self._dead: BaseException | None = None
        self.sessions = SessionStore(self.config.kv_cache_tokens, self.config.kv_cache_sessions)
        self._cache = PrefixCacheStats()  # summed cached_tokens of the generations returned
        self._thread = threading.Thread(target=self._run, name="miles-env-hf-engine", daemon=True)
        self._thread.start()

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
        req = _Request(ids, sampling, session_id, loop, loop.create_future())
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
        """Apply a `WeightDelta` (miles_env.trainer.weight_sync) taking `delta.base_version` to
        `delta.new_version`; a corrupted, partial or wrong-base delta raises EngineError and leaves the
        weights and the version unchanged (a full update_weights repairs)."""
        return int(
            await self._command(
                "update", state_dict=delta, weight_version=delta.new_version, abort_in_flight=abort_in_flight
            )
        )

    async def apply_weight_delta_from_disk(self, path: str | Path, *, abort_in_flight: bool = False) -> int:
        """Load a delta file written by `save_delta` and apply it (see apply_weight_delta)."""
        from miles_env.trainer.weight_sync import DeltaError, load_delta

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
        if self._thread.is_alive():
            await self._command("close")
            self._closed = True  # from here on nothing is accepted
            await anyio.to_thread.run_sync(self._thread.join)
        self._closed = True
        self._fail_all(
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

    def _submit(self, item: _Request | _Command) -> None:
        if self._closed or not self._thread.is_alive():
            raise EngineError(f"hf engine is closed{f' (worker died: {self._dead!r})' if self._dead else ''}")
        self._inbox.put(item)

    async def _command(self, kind: Literal["update", "flush", "close", "score"], **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        cmd = _Command(kind, loop, loop.create_future(), **kw)
        self._submit(cmd)
        return await cmd.future

    # ---- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        if self.threads > 0 and self.device.type == "cpu":
            torch.set_num_threads(self.threads)  # OpenMP pools are per thread: set it where the model runs
        try:
            with torch.inference_mode():
                while self._serve_once():
                    pass
        except BaseException as e:  # never die silently: fail everyone who waits
            self._dead = e
            self._fail_all(EngineError(f"hf engine worker failed: {e!r}"))
            raise

    def _serve_once(self) -> bool:
        idle = not (self._batch.rows or self._prefilling or self._waiting or self._pending)
        self._drain_inbox(block=idle)
        for cmd in [c for c in self._pending if c.kind in ("flush", "close", "score")]:
            self._pending.remove(cmd)
            if cmd.kind == "score":
                self._score(cmd)
                continue
            if cmd.kind == "close":
                self._fail_all(EngineError("hf engine closed"))
                _resolve(cmd.loop, cmd.future, None, None)
                return False
            self.sessions.clear()
            _resolve(cmd.loop, cmd.future, None, None)
        if self._pending:
            # rows still prefilling have sampled nothing: restart them after the update
            while self._prefilling:
                self._waiting.appendleft(self._prefilling.pop().req)
            if self._batch.rows and any(c.abort_in_flight for c in self._pending):
                self._finish(self._batch.abort_all())
            if not self._batch.rows:
                self._apply_updates()
        if not self._pending:
            self._admit()
            self._prefill()
        if self._batch.rows:
            try:
                finished = self._batch.step()
            except Exception as e:  # e.g. out of memory: fail this batch, keep serving
                err = EngineError(f"hf engine: decode step failed: {e!r}")
                for row in self._batch.rows:
                    _resolve(row.req.loop, row.req.future, None, err)
                self._batch.clear()
                return True
            self._finish(finished)
        return True

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                if isinstance(item, _Request):
                    self._waiting.append(item)
                else:
                    self._pending.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        while self._waiting and len(self._batch.rows) + len(self._prefilling) < self.config.max_batch_size:
            req = self._waiting.popleft()
            if not req.cancelled:
                self._prefilling.append(
                    self._batch.start(req, req.input_ids, req.params, self.weight_version, self.max_context)
                )

    def _prefill(self) -> None:
        """Prefill waiting rows one at a time: a chunk budget per step while rows decode, else all."""
        budget = self.config.prefill_chunk_tokens if self._batch.rows else 1 << 62
        while self._prefilling and budget > 0:
            row = self._prefilling[0]
            req: _Request = row.req
            if req.cancelled:
                self._prefilling.popleft()
                continue
            if row.fed == 0:  # looked up now, not at admission: an earlier sibling's prompt is stored by now
                self._batch.reuse(row, self.sessions.lookup(req.input_ids, req.session_id)[0])
            try:
                budget -= self._batch.prefill_chunk(row, budget)
            except Exception as e:
                self._prefilling.popleft()
                _resolve(req.loop, req.future, None, EngineError(f"hf engine: prefill failed: {e!r}"))
                continue
            if not row.output:
                continue
            self._prefilling.popleft()
            req.ttft = time.perf_counter() - req.t0
            if len(req.input_ids) - row.cached >= _SHARE_MIN_TOKENS and row.kv is not None:
                # a cold prompt: later requests that start the same way (GRPO siblings, a shared
                # system prompt) reuse it from any session
                self.sessions.put(f"prompt:{hash(tuple(req.input_ids))}", SessionEntry(req.input_ids, row.kv))
            if row.finish is not None:
                self._finish([row])
            else:
                self._batch.join(row)

    def _finish(self, rows: list[Row]) -> None:
        for row in rows:
            req: _Request = row.req
            if req.session_id and row.kv is not None and row.finish != "abort":
                self.sessions.put(req.session_id, row.session_entry())
            gen = Generation(
                output_ids=list(row.output),
                logprobs=list(row.logprobs),
                finish_reason=row.finish or "abort",
                weight_version=row.version,
                prompt_len=len(req.input_ids),
                cached_tokens=row.cached,
                latency_s=time.perf_counter() - req.t0,
                meta={"matched": row.matched, "ttft_s": req.ttft}
                | ({"message": "aborted: weight update or cancel"} if row.finish == "abort" else {})
                | ({"routed_experts": row.routed} if row.routed else {}),  # MoE: _batch.py
            )
            _resolve(req.loop, req.future, gen, None)

    def _score(self, cmd: _Command) -> None:
        assert cmd.sequences is not None
        try:
            value = score_sequences(self.model, self.device, cmd.sequences, _SCORE_TOKENS)
        except Exception as e:  # e.g. out of memory: this call fails, the engine keeps serving
            _resolve(cmd.loop, cmd.future, None, EngineError(f"hf engine: score failed: {e!r}"))
            return
        _resolve(cmd.loop, cmd.future, value, None)

    def _apply_updates(self) -> None:
        for cmd in [c for c in self._pending if c.kind == "update"]:
            self._pending.remove(cmd)
            try:
                assert cmd.state_dict is not None
                apply_update(self.model, cmd.state_dict, self.weight_version)
            except Exception as e:
                err = e if isinstance(e, EngineError) else EngineError(f"update_weights failed: {e!r}")
                _resolve(cmd.loop, cmd.future, None, err)
                continue
            self.sessions.clear()  # cached KV was computed by the old weights
            self.weight_version = (
                cmd.weight_version if cmd.weight_version is not None else self.weight_version + 1
            )
            _resolve(cmd.loop, cmd.future, self.weight_version, None)

    def _fail_all(self, err: EngineError) -> None:
        self._drain_inbox(block=False)
        for req in list(self._waiting) + [r.req for r in [*self._prefilling, *self._batch.rows]]:
            _resolve(req.loop, req.future, None, err)
        for cmd in self._pending:
            _resolve(cmd.loop, cmd.future, None, err)
        self._waiting.clear()
        self._prefilling.clear()
        self._pending.clear()
        self._batch.clear()
