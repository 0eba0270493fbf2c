"""Shared helpers for the TITO tests (a helpers module, not a test module): a served proxy.

`served(tokenizer, ...)` serves a `TitoProxy` over a ScriptedEngine (or the engine given);
`threaded(...)` serves it on an event loop in a background thread, for sync tests that drive
raw sockets (`Raw`, one keep-alive HTTP/1.1 connection spoken with h11) or hypothesis;
`error_shape` checks a dialect's error body. `check_fidelity` is the token-exactness check
every TITO and harness test ends with; `RecordingEngine` wraps a real engine so that check
can run against it (it keeps each Generation as the scripted engine does).
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import h11
import httpx
from anyio.from_thread import BlockingPortal, start_blocking_portal
from openai import AsyncOpenAI

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.engines.scripted import ScriptedCall, ScriptedEngine
from miles_env.http import serve_app
from miles_env.tito import TitoConfig, TitoProxy, create_app
from miles_env.types import Trajectory

__all__ = [
    "ADMIN",
    "TOOLS",
    "Raw",
    "RecordingEngine",
    "Reply",
    "Served",
    "Threaded",
    "check_fidelity",
    "error_shape",
    "served",
    "strict_json",
    "threaded",
]

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


def check_fidelity(
    trajs: list[Trajectory], engine: ScriptedEngine | RecordingEngine, session_id: str
) -> None:
    """Every mask-1 run equals one recorded engine generation (ids and logprobs), a turn the agent
    never received (`delivered=False`) has mask 0 and logprob 0.0 over its ids, each generation is
    one listed turn, and nothing else has mask 1."""
    gens = [c.generation for c in engine.calls if c.session_id == session_id]
    runs: list[tuple[list[int], list[float]]] = []
    ids_seen: list[list[int]] = []
    for t in trajs:
        for turn in t.turns:
            s, e = turn.start, turn.start + turn.completion_len
            ids_seen.append(t.token_ids[s:e])
            if turn.delivered:
                runs.append((t.token_ids[s:e], t.logprobs[s:e]))
                assert t.loss_mask[s:e] == [1] * turn.completion_len
            else:
                assert t.loss_mask[s:e] == [0] * turn.completion_len and not any(t.logprobs[s:e])
        assert sum(t.loss_mask) == sum(turn.completion_len for turn in t.turns if turn.delivered)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
    assert sorted(map(repr, ids_seen)) == sorted(repr(g.output_ids) for g in gens)
    recorded = {repr((g.output_ids, g.logprobs)) for g in gens}
    assert all(repr(r) in recorded for r in runs)


T = TypeVar("T")


def strict_json(data: bytes | str) -> Any:
    """json.loads that refuses NaN/Infinity: what a strict client (or jq) accepts."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(data, parse_constant=refuse)


def error_shape(dialect: str, body: bytes) -> dict[str, Any]:
    """The error object of a dialect's error body, after checking its exact shape."""
    data = strict_json(body)
    if dialect == "anthropic":
        assert data["type"] == "error" and set(data) == {"type", "error"}, data
        assert set(data["error"]) == {"type", "message"} and data["error"]["message"], data
    else:
        assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "code", "param"}, data
        assert data["error"]["message"], data
    return dict(data["error"])


@dataclass
class Threaded:
    """A served proxy whose event loop runs in a background thread."""

    served: Served
    portal: BlockingPortal
    store: Path | None

    @property
    def url(self) -> str:
        return self.served.url

    @property
    def proxy(self) -> TitoProxy:
        return self.served.proxy

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in the loop's thread (the proxy is not shared across threads)."""
        return self.portal.call(fn, *args)

    def session(self, **kw: Any) -> Any:
        return self.call(lambda: self.proxy.create_session(**kw))

    def info(self, session_id: str) -> Any:
        return self.call(self.proxy.get_session, session_id)

    def journal(self, session_id: str) -> list[dict[str, Any]]:
        assert self.store is not None
        return [strict_json(x) for x in (self.store / f"{session_id}.jsonl").read_bytes().splitlines()]


@contextmanager
def threaded(
    tokenizer: Any, engine: ScriptedEngine | None = None, store_dir: Path | None = None, **cfg: Any
) -> Iterator[Threaded]:
    with start_blocking_portal("asyncio") as portal:
        with portal.wrap_async_context_manager(served(tokenizer, engine, store_dir, **cfg)) as s:
            yield Threaded(s, portal, store_dir)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return strict_json(self.body)


class Raw:
    """One HTTP/1.1 connection, spoken with h11 over a blocking socket: shows whether it survives."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        u = httpx.URL(url)
        self.host = f"{u.host}:{u.port}"
        self.sock = socket.create_connection((u.host, u.port or 80), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    @property
    def alive(self) -> bool:
        """Both sides done with the last exchange and neither asked to close."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            self.sock.sendall(data)

    def head(self, method: str, path: str, length: int | None, headers: dict[str, str] | None = None) -> None:
        if self.alive:
            self.conn.start_next_cycle()
        hdrs = [("host", self.host), *(headers or {}).items()]
        hdrs.append(
            ("content-length", str(length)) if length is not None else ("transfer-encoding", "chunked")
        )
        self._send(h11.Request(method=method, target=path, headers=hdrs))

    def data(self, chunk: bytes) -> None:
        self._send(h11.Data(data=chunk))

    def end(self) -> None:
        self._send(h11.EndOfMessage())

    def response(self) -> Reply:
        status, headers, body = 0, {}, bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Reply(status, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection without a response")

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Reply:
        if self.alive:
            self.conn.start_next_cycle()
        hdrs = [("host", self.host), *(headers or {}).items(), ("content-length", str(len(body)))]
        out = self.conn.send(h11.Request(method=method, target=path, headers=hdrs)) or b""
        out += (self.conn.send(h11.Data(data=body)) or b"") if body else b""
        self.sock.sendall(out + (self.conn.send(h11.EndOfMessage()) or b""))  # one write: no Nagle stall
        return self.response()


class RecordingEngine:
    """Delegates to a real engine and keeps its Generations (the engine's own record)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.calls: list[ScriptedCall] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        gen = await self.inner.generate(input_ids, sampling, session_id=session_id)
        self.calls.append(ScriptedCall(tuple(input_ids), sampling, session_id, gen))
        return gen

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        return await self.inner.update_weights_from_disk(path, weight_version)

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def close(self) -> None:
        await self.inner.close()
