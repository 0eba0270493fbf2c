"""Shared fixtures for the TITO tests: the real SmolLM2 tokenizer, a ScriptedEngine, a served proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.tito import TitoConfig, TitoProxy, create_app
from openai import AsyncOpenAI

from miles_env.engines.scripted import ScriptedEngine
from miles_env.http import serve_app
from miles_env.types import Trajectory

ADMIN = "admin-secret"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@dataclass
class Served:
    proxy: TitoProxy
    engine: ScriptedEngine
    url: str
    clients: list[AsyncOpenAI] = field(default_factory=list)

    def client(self, session_id: str) -> AsyncOpenAI:
        """An official openai client on the session's endpoint, closed when `served` exits."""
        ep = self.proxy.endpoint(session_id, self.url)
        c = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        self.clients.append(c)
        return c


@asynccontextmanager
async def served(
    tokenizer: Any, engine: ScriptedEngine | None = None, store_dir: Path | None = None, **cfg: Any
) -> AsyncIterator[Served]:
    engine = engine or ScriptedEngine(tokenizer)
    proxy = TitoProxy(engine, tokenizer, TitoConfig(admin_token=ADMIN, **cfg), store_dir=store_dir)
    async with serve_app(create_app(proxy)) as url:
        s = Served(proxy, engine, url)
        try:
            yield s
        finally:
            for c in s.clients:
                await c.close()


def check_fidelity(trajs: list[Trajectory], engine: ScriptedEngine, session_id: str) -> None:
    """Every mask-1 run equals one recorded engine generation (ids and logprobs), and nothing else has mask 1."""
    gens = [c.generation for c in engine.calls if c.session_id == session_id]
    runs: list[tuple[list[int], list[float]]] = []
    for t in trajs:
        for turn in t.turns:
            s, e = turn.start, turn.start + turn.completion_len
            runs.append((t.token_ids[s:e], t.logprobs[s:e]))
            assert t.loss_mask[s:e] == [1] * turn.completion_len
        assert sum(t.loss_mask) == sum(turn.completion_len for turn in t.turns)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
    assert sorted(map(repr, runs)) == sorted(repr((g.output_ids, g.logprobs)) for g in gens)
