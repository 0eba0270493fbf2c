"""ScriptedEngine: an Engine with zero model cost, for tests, demos and benchmarks.

Concept: replies are queued (per session, or globally) as text or as raw ids. A
text reply is encoded with the real tokenizer and ends with the stop token
(`<|im_end|>` for chatml models); an id reply is emitted verbatim, which is how a
test produces ids that would not survive a decode/encode round trip. With no
queued reply the engine falls back to `echo_tokens` filler tokens (benchmarks) or
to `default_reply`.

Invariant: every Generation returned is also appended to `generations` (and the
full call to `calls`), so tests can compare a proxy's trajectory with what the
engine really produced. Logprobs are a deterministic function of (position, id).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from miles_env.engines.base import EngineInfo, Generation, SamplingParams

__all__ = ["ScriptedEngine", "ScriptedCall", "pseudo_logprob"]

Reply = str | Sequence[int]


def pseudo_logprob(position: int, token_id: int) -> float:
    """A deterministic value in [-1.0, -0.001]; distinct enough to catch misalignment."""
    return -(((token_id * 2654435761 + position * 40503) % 1000) + 1) / 1000.0


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str | None
    generation: Generation


class ScriptedEngine:
    """An Engine that emits scripted replies; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any = None,
        replies: Iterable[Reply] = (),
        *,
        echo_tokens: int | None = None,
        default_reply: str = "OK",
        max_context: int = 8192,
        weight_version: int = 0,
        stop_token: str = "<|im_end|>",
        delay_s: float = 0.0,
        record: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.weight_version = weight_version
        self.echo_tokens = echo_tokens
        self.default_reply = default_reply
        self.delay_s = delay_s
        self.record = record
        self.stop_id: int | None = None
        if tokenizer is not None:
            sid = tokenizer.convert_tokens_to_ids(stop_token)
            self.stop_id = sid if isinstance(sid, int) and sid >= 0 else tokenizer.eos_token_id
        self._global: deque[Reply] = deque(replies)
        self._per_session: dict[str, deque[Reply]] = defaultdict(deque)
        self.generations: list[Generation] = []
        self.calls: list[ScriptedCall] = []
        self._filler: list[int] = self._make_filler()

    def _make_filler(self) -> list[int]:
        if self.tokenizer is None:
            return list(range(100, 164))
        ids = self.tokenizer.encode(
            "the quick brown fox jumps over the lazy dog and keeps running ", add_special_tokens=False
        )
        return list(ids)

    def push(self, *replies: Reply, session_id: str | None = None) -> None:
        """Queue replies; with `session_id` they are served only to that session."""
        queue = self._global if session_id is None else self._per_session[session_id]
        queue.extend(replies)

    def _encode_reply(self, reply: Reply) -> list[int]:
        if isinstance(reply, str):
            if self.tokenizer is None or self.stop_id is None:
                raise ValueError("ScriptedEngine: a text reply needs a tokenizer")
            return [*self.tokenizer.encode(reply, add_special_tokens=False), self.stop_id]
        return [int(i) for i in reply]

    def _next_ids(self, session_id: str | None) -> list[int]:
        queue = self._per_session.get(session_id) if session_id is not None else None
        if queue:
            return self._encode_reply(queue.popleft())
        if self._global:
            return self._encode_reply(self._global.popleft())
        if self.echo_tokens is not None:
            n = max(self.echo_tokens - 1, 0)
            filler = (self._filler * (n // len(self._filler) + 1))[:n]
            return filler + ([self.stop_id] if self.stop_id is not None else [self._filler[0]])
        return self._encode_reply(self.default_reply)

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if self.delay_s > 0:
            await anyio.sleep(self.delay_s)
        else:
            await anyio.lowlevel.checkpoint()
        ids = self._next_ids(session_id)
        stops = set(sampling.stop_token_ids)
        if self.stop_id is not None:
            stops.add(self.stop_id)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        if cut is not None:
            ids = ids[:cut]
        finish = "stop" if cut is not None else "length"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        start = len(input_ids)
        gen = Generation(
            output_ids=ids,
            logprobs=[pseudo_logprob(start + i, t) for i, t in enumerate(ids)],
            finish_reason=finish,
            weight_version=self.weight_version,
            prompt_len=len(input_ids),
        )
        if self.record:
            self.generations.append(gen)
            self.calls.append(ScriptedCall(tuple(input_ids), sampling, session_id, gen))
        return gen

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
        return self.weight_version

    async def info(self) -> EngineInfo:
        eos = (self.stop_id,) if self.stop_id is not None else ()
        return EngineInfo("scripted", "scripted", self.weight_version, self.max_context, eos)

    async def close(self) -> None:
        return None
