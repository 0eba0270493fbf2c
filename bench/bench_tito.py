"""TITO proxy overhead per turn and concurrent throughput, against the engine called directly.

One run, ScriptedEngine (zero model cost, so every microsecond measured is proxy):
- per-turn latency at ~1k and ~16k tokens of history: engine.generate() directly,
  TitoProxy.chat() in process (core only), and the full HTTP path (httpx ->
  uvicorn -> chat completions) with an HTTP floor (GET /health) for reference;
- turns per second across 64 concurrent sessions over HTTP;
- per-turn added latency of the three dialects (chat completions, Responses,
  Anthropic Messages) at the same history length, turns interleaved across the
  dialects so machine load hits all three alike (`--dialects-only` runs just this).

    python bench/bench_tito.py [--turns 20] [--sessions 10] [--dialects-only]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import uvicorn
from miles_env.tito import TitoConfig, TitoProxy, create_app
from miles_env.tito.messages import ChatRequest, Message

from miles_env.engines.base import SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.http import free_port
from miles_env.models import load_tokenizer

ECHO = 8  # tokens the engine emits per turn


@asynccontextmanager
async def serve(app) -> AsyncIterator[str]:
    """uvicorn on loopback, binding its own socket: getaddrinfo gives proto=IPPROTO_TCP, so asyncio
    sets TCP_NODELAY on accepted connections (a socket made with proto 0 does not get it, and each
    response then waits ~40 ms for a delayed ACK)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def filler(tok, n_tokens: int) -> str:
    unit = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    per = len(tok.encode(unit, add_special_tokens=False))
    return unit * max(1, n_tokens // per)


async def build_history(http: httpx.AsyncClient, sid: str, key: str, tok, target: int) -> list[dict]:
    """Grow a session to about `target` tokens with a few long user turns."""
    msgs: list[dict] = []
    chunk = filler(tok, min(1000, target // 4))
    used = 0
    while used < target:
        msgs.append({"role": "user", "content": chunk})
        r = await http.post(
            f"/s/{sid}/v1/chat/completions", json={"messages": msgs}, headers={"x-api-key": key}
        )
        body = r.json()
        used = body["usage"]["total_tokens"]
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return msgs


async def http_turns(http, sid, key, msgs, n) -> tuple[list[float], int]:
    lat, tokens = [], 0
    for i in range(n):
        msgs.append({"role": "user", "content": f"ok {i}"})
        t0 = time.perf_counter()
        r = await http.post(
            f"/s/{sid}/v1/chat/completions", json={"messages": msgs}, headers={"x-api-key": key}
        )
        lat.append(time.perf_counter() - t0)
        body = r.json()
        tokens = body["usage"]["total_tokens"]
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return lat, tokens


async def inproc_turns(proxy: TitoProxy, sid: str, msgs: list[dict], n: int) -> list[float]:
    conv = [Message(m["role"], m["content"]) for m in msgs]
    lat = []
    for i in range(n):
        conv.append(Message("user", f"ok {i}"))
        t0 = time.perf_counter()
        res = await proxy.chat(sid, ChatRequest(tuple(conv)))
        lat.append(time.perf_counter() - t0)
        conv.append(Message("assistant", res.text))
    return lat


async def direct_turns(engine: ScriptedEngine, n_prompt: int, n: int) -> list[float]:
    ids = list(range(1000, 1000 + n_prompt))
    sp = SamplingParams(max_new_tokens=64, stop_token_ids=(2,))
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await engine.generate(ids, sp, session_id="x")
        lat.append(time.perf_counter() - t0)
    return lat


async def latency_row(proxy, journaled, engine, url, tok, target, turns, sessions) -> dict:
    direct = await direct_turns(engine, target, turns * sessions)
    via_http, via_core, via_journal, floor, final = [], [], [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(sessions):
            h = proxy.create_session()
            msgs = await build_history(http, h.session_id, h.api_key, tok, target)
            lat, final = await http_turns(http, h.session_id, h.api_key, msgs, turns)
            via_http += lat
            h2 = proxy.create_session()
            msgs2 = await build_history(http, h2.session_id, h2.api_key, tok, target)
            via_core += await inproc_turns(proxy, h2.session_id, msgs2, turns)
            h3 = journaled.create_session()
            conv = [Message("user", filler(tok, target))]
            await journaled.chat(h3.session_id, ChatRequest(tuple(conv)))
            msgs3 = [{"role": "user", "content": conv[0].content}, {"role": "assistant", "content": ""}]
            msgs3[1]["content"] = journaled.renderer.decode(
                journaled.export(h3.session_id)[0].token_ids[-ECHO:-1]
            )
            via_journal += await inproc_turns(journaled, h3.session_id, msgs3, turns)
            for _ in range(turns):
                t0 = time.perf_counter()
                await http.get("/health")
                floor.append(time.perf_counter() - t0)
    d50 = statistics.median(direct)
    return {
        "history": target,
        "final": final,
        "direct": d50,
        "core": statistics.median(via_core) - d50,
        "journal": statistics.median(via_journal) - d50,
        "floor": statistics.median(floor),
        "http50": statistics.median(via_http),
        "added50": statistics.median(via_http) - d50,
        "added90": pct(via_http, 0.9) - d50,
    }


async def direct_throughput(engine: ScriptedEngine, n_sessions: int, turns: int) -> float:
    sp = SamplingParams(max_new_tokens=64)

    async def one(i: int) -> None:
        ids = list(range(1000, 1100))
        for _ in range(turns):
            gen = await engine.generate(ids, sp, session_id=str(i))
            ids = ids + gen.output_ids + [1, 2, 3]

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n_sessions):
            tg.start_soon(one, i)
    return n_sessions * turns / (time.perf_counter() - t0)


async def throughput(proxy, url, n_sessions: int, turns: int) -> float:
    handles = [proxy.create_session() for _ in range(n_sessions)]
    limits = httpx.Limits(max_connections=n_sessions, max_keepalive_connections=n_sessions)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def one(h) -> None:
            msgs: list[dict] = [{"role": "user", "content": "start"}]
            for i in range(turns):
                r = await http.post(
                    f"/s/{h.session_id}/v1/chat/completions",
                    json={"messages": msgs},
                    headers={"x-api-key": h.api_key},
                )
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"go {i}"}]

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(one, h)
        return n_sessions * turns / (time.perf_counter() - t0)


class Dialect:
    """One dialect's wire format for the same conversation: path, request body, reply appended to history."""

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path

    def body(self, history: list[dict]) -> dict:
        if self.name == "chat":
            return {"messages": history}
        if self.name == "responses":
            return {"input": history, "store": False}
        return {"messages": history, "max_tokens": 64}

    def user(self, text: str) -> dict:
        return {"role": "user", "content": text}

    def reply(self, body: dict) -> list[dict]:
        if self.name == "chat":
            return [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
        if self.name == "responses":
            return body["output"]
        return [{"role": "assistant", "content": body["content"]}]


DIALECTS = [
    Dialect("chat", "/v1/chat/completions"),
    Dialect("responses", "/v1/responses"),
    Dialect("messages", "/v1/messages"),
]


async def dialect_rows(proxy: TitoProxy, url: str, tok, target: int, turns: int, sessions: int) -> dict:
    lat: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def turn(d: Dialect, h, hist: list[dict], text: str) -> float:
            hist.append(d.user(text))
            t0 = time.perf_counter()
            r = await http.post(
                f"/s/{h.session_id}{d.path}", json=d.body(hist), headers={"x-api-key": h.api_key}
            )
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            hist += d.reply(r.json())
            return dt

        chunk = filler(tok, min(1000, target // 4))
        for _ in range(sessions):
            state = [(d, proxy.create_session(), []) for d in DIALECTS]
            for _ in range(max(1, target // min(1000, target // 4) - 1)):  # same history in every dialect
                for d, h, hist in state:
                    await turn(d, h, hist, chunk)
            for i in range(turns):
                for d, h, hist in state:
                    lat[d.name].append(await turn(d, h, hist, f"ok {i}"))
    return {k: statistics.median(v) for k, v in lat.items()}


async def dialects_main(turns: int, sessions: int) -> None:
    tok = load_tokenizer()
    engine = ScriptedEngine(tok, echo_tokens=ECHO, max_context=65536, record=False)
    d50 = statistics.median(await direct_turns(engine, 1000, 200))
    proxy = TitoProxy(engine, tok, TitoConfig())
    async with serve(create_app(proxy)) as url:
        rows = [(n, await dialect_rows(proxy, url, tok, n, turns, sessions)) for n in (1000, 16000)]
    print(
        f"{'history':>8} {'chat p50':>10} {'responses':>10} {'messages':>10} {'resp/chat':>10} {'msgs/chat':>10}"
    )
    for n, r in rows:
        c, o, m = (r[k] - d50 for k in ("chat", "responses", "messages"))
        print(f"{n:>8} {c * 1e3:>8.3f}ms {o * 1e3:>8.3f}ms {m * 1e3:>8.3f}ms {o / c:>9.2f}x {m / c:>9.2f}x")
    print("added per-turn latency over the engine called directly (p50); target: ratios <= 1.5x")


async def main(turns: int, sessions: int) -> None:
    tok = load_tokenizer()
    engine = ScriptedEngine(tok, echo_tokens=ECHO, max_context=65536, record=False)
    proxy = TitoProxy(engine, tok, TitoConfig())
    with tempfile.TemporaryDirectory() as store:
        journaled = TitoProxy(engine, tok, TitoConfig(), store_dir=Path(store))
        async with serve(create_app(proxy)) as url:
            rows = [
                await latency_row(proxy, journaled, engine, url, tok, n, turns, sessions)
                for n in (1000, 16000)
            ]
            tps = await throughput(proxy, url, 64, turns)
    base_tps = await direct_throughput(engine, 64, turns)
    ms = 1e3
    print(f"{'history':>8} {'tokens':>7} {'engine':>9} {'core+':>8} {'core+jrnl':>9} {'http floor':>10} "
          f"{'proxy p50':>10} {'added p50':>10} {'added p90':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['history']:>8} {r['final']:>7} {r['direct'] * ms:>7.3f}ms {r['core'] * ms:>6.3f}ms "
            f"{r['journal'] * ms:>7.3f}ms "
            f"{r['floor'] * ms:>8.3f}ms {r['http50'] * ms:>8.3f}ms {r['added50'] * ms:>8.3f}ms {r['added90'] * ms:>8.3f}ms"
        )
    print(f"added p50 16k / 1k: {rows[1]['added50'] / rows[0]['added50']:.2f}x (target <= 2x)")
    print(f"core added 16k / 1k: {rows[1]['core'] / rows[0]['core']:.2f}x")
    print(f"added p50 at 1k: {rows[0]['added50'] * ms:.3f} ms (target < 2 ms)")
    print(
        f"64 concurrent sessions over HTTP: {tps:.0f} turns/s ({ECHO} tokens per turn, client in the same process)"
    )
    print(f"64 concurrent sessions, engine direct: {base_tps:.0f} turns/s; proxy/direct {tps / base_tps:.4f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--dialects-only", action="store_true")
    a = ap.parse_args()
    if not a.dialects_only:
        anyio.run(main, a.turns, a.sessions)
    anyio.run(dialects_main, a.turns, a.sessions)
