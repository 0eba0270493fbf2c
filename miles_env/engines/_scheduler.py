"""The embedded engine's worker thread: one continuous-batching loop over requests and commands.

Concept: callers (hf.py's `HFEngine`, from any asyncio loop) put a `Request` or a `Command` into
the inbox and await its future. The worker prefills each new request alone (reusing its
session's KV prefix when the new ids extend it), in chunks while other rows decode, then lets it
join the running decode batch (_batch.py) at a step boundary; a decode step feeds one token per
row. Finished rows leave the batch and their KV becomes the session's cached prefix; a cold
prompt's KV is kept too, so any request starting with the same ids (GRPO siblings, a shared system
prompt) skips that part (_kv.py: LRU, token budget). Results go back through
`loop.call_soon_threadsafe` on the caller's loop (`resolve`).

Invariants: every Generation was sampled under one weight version. An update command stops
admission, waits for the running rows to finish (or aborts them), swaps the tensors, flushes every
cached KV, sets the version and resumes; rows still prefilling restart under the new weights. The
worker never dies silently: anything it raises fails everyone who waits.

Lifecycle: `Scheduler(...)` then `start()`; the worker owns the model, the batch and the session
store from then on. A `close` command fails what is pending and ends the loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_env.engines._batch import Batch, Row
from miles_env.engines._kv import SessionEntry, SessionStore
from miles_env.engines._score import score_sequences
from miles_env.engines._weights import apply_update
from miles_env.engines.base import Generation, SamplingParams
from miles_env.errors import EngineError

__all__ = ["Command", "CommandKind", "Request", "Scheduler", "resolve"]

_SHARE_MIN_TOKENS = 32  # a prompt prefilled with at least this many uncached tokens is shared
_SCORE_TOKENS = 2048  # padded tokens per scoring forward pass (its float32 logits are tokens x vocab)

CommandKind = Literal["update", "flush", "close", "score"]


@dataclass(slots=True, eq=False)
class Request:
    input_ids: list[int]
    params: SamplingParams
    session_id: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    t0: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    cancelled: bool = False


@dataclass(slots=True, eq=False)
class Command:
    kind: CommandKind
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    state_dict: Any = None  # a (partial) state dict, a WeightDelta or a LoraAdapter
    weight_version: int | None = None
    abort_in_flight: bool = False
    sequences: list[list[int]] | None = None  # score: the sequences to score


def resolve(
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


class Scheduler:
    """The worker thread's state: requests waiting, rows prefilling, commands pending, the batch."""

    def __init__(
        self,
        batch: Batch,
        sessions: SessionStore,
        *,
        threads: int,
        max_batch_size: int,
        prefill_chunk_tokens: int,
        max_context: int,
    ) -> None:
        self.batch, self.sessions = batch, sessions  # the batch holds the model and its device
        self.threads, self.max_batch_size = threads, max_batch_size
        self.prefill_chunk_tokens, self.max_context = prefill_chunk_tokens, max_context
        self.weight_version = 0  # written by the worker only
        self.inbox: queue.SimpleQueue[Request | Command] = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._prefilling: deque[Row] = deque()
        self._pending: list[Command] = []
        self.dead: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="miles-env-hf-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import torch

        if self.threads > 0 and self.batch.device.type == "cpu":
            torch.set_num_threads(self.threads)  # OpenMP pools are per thread: set it where the model runs
        try:
            with torch.inference_mode():
                while self._serve_once():
                    pass
        except BaseException as e:  # never die silently: fail everyone who waits
            self.dead = e
            self.fail_all(EngineError(f"hf engine worker failed: {e!r}"))
            raise

    def _serve_once(self) -> bool:
        idle = not (self.batch.rows or self._prefilling or self._waiting or self._pending)
        self._drain_inbox(block=idle)
        for cmd in [c for c in self._pending if c.kind in ("flush", "close", "score")]:
            self._pending.remove(cmd)
            if cmd.kind == "score":
                self._score(cmd)
                continue
            if cmd.kind == "close":
                self.fail_all(EngineError("hf engine closed"))
                resolve(cmd.loop, cmd.future, None, None)
                return False
            self.sessions.clear()
            resolve(cmd.loop, cmd.future, None, None)
        if self._pending:
            # rows still prefilling have sampled nothing: restart them after the update
            while self._prefilling:
                self._waiting.appendleft(self._prefilling.pop().req)
            if self.batch.rows and any(c.abort_in_flight for c in self._pending):
                self._finish(self.batch.abort_all())
            if not self.batch.rows:
                self._apply_updates()
        if not self._pending:
            self._admit()
            self._prefill()
        if self.batch.rows:
            try:
                finished = self.batch.step()
            except Exception as e:  # e.g. out of memory: fail this batch, keep serving
                err = EngineError(f"hf engine: decode step failed: {e!r}")
                for row in self.batch.rows:
                    resolve(row.req.loop, row.req.future, None, err)
                self.batch.clear()
                return True
            self._finish(finished)
        return True

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(block=block)
            while True:
                if isinstance(item, Request):
                    self._waiting.append(item)
                else:
                    self._pending.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        while self._waiting and len(self.batch.rows) + len(self._prefilling) < self.max_batch_size:
            req = self._waiting.popleft()
            if not req.cancelled:
                self._prefilling.append(
                    self.batch.start(req, req.input_ids, req.params, self.weight_version, self.max_context)
                )

    def _prefill(self) -> None:
        """Prefill waiting rows one at a time: a chunk budget per step while rows decode, else all."""
        budget = self.prefill_chunk_tokens if self.batch.rows else 1 << 62
        while self._prefilling and budget > 0:
            row = self._prefilling[0]
            req: Request = row.req
            if req.cancelled:
                self._prefilling.popleft()
                continue
            if row.fed == 0:  # looked up now, not at admission: an earlier sibling's prompt is stored by now
                self.batch.reuse(row, self.sessions.lookup(req.input_ids, req.session_id)[0])
            try:
                budget -= self.batch.prefill_chunk(row, budget)
            except Exception as e:
                self._prefilling.popleft()
                resolve(req.loop, req.future, None, EngineError(f"hf engine: prefill failed: {e!r}"))
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
                self.batch.join(row)

    def _finish(self, rows: list[Row]) -> None:
        for row in rows:
            req: Request = row.req
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
            resolve(req.loop, req.future, gen, None)

    def _score(self, cmd: Command) -> None:
        assert cmd.sequences is not None
        try:
            value = score_sequences(self.batch.model, self.batch.device, cmd.sequences, _SCORE_TOKENS)
        except Exception as e:  # e.g. out of memory: this call fails, the engine keeps serving
            resolve(cmd.loop, cmd.future, None, EngineError(f"hf engine: score failed: {e!r}"))
            return
        resolve(cmd.loop, cmd.future, value, None)

    def _apply_updates(self) -> None:
        for cmd in [c for c in self._pending if c.kind == "update"]:
            self._pending.remove(cmd)
            try:
                assert cmd.state_dict is not None
                apply_update(self.batch.model, cmd.state_dict, self.weight_version)
            except Exception as e:
                err = e if isinstance(e, EngineError) else EngineError(f"update_weights failed: {e!r}")
                resolve(cmd.loop, cmd.future, None, err)
                continue
            self.sessions.clear()  # cached KV was computed by the old weights
            self.weight_version = (
                cmd.weight_version if cmd.weight_version is not None else self.weight_version + 1
            )
            resolve(cmd.loop, cmd.future, self.weight_version, None)

    def fail_all(self, err: EngineError) -> None:
        """Fail every request and command not yet answered (worker thread, or after it ended)."""
        self._drain_inbox(block=False)
        for req in list(self._waiting) + [r.req for r in [*self._prefilling, *self.batch.rows]]:
            resolve(req.loop, req.future, None, err)
        for cmd in self._pending:
            resolve(cmd.loop, cmd.future, None, err)
        self._waiting.clear()
        self._prefilling.clear()
        self._pending.clear()
        self.batch.clear()
