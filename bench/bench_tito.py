"""TITO proxy overhead per turn, the HTTP stack under it, and LiteLLM's proxy on the same work.

Zero model cost everywhere (ScriptedEngine emitting ECHO tokens per turn), so every microsecond
measured is proxy. Each figure is the median over --rounds rounds of a per-round p50 over
--sessions fresh sessions x --turns measured turns; sizes and contenders alternate inside a round
so machine load hits them alike.

1. In process, at ~1k and ~16k tokens of history: the engine called directly, the proxy core
   (TitoProxy.chat, no HTTP; with and without a journal), the HTTP floor (GET /health) and a
   chat-completions turn over HTTP (httpx -> uvicorn -> TITO, both in this process, on the event
   loop miles_env.http.loop_options() picks: uvloop when installed). Added = HTTP turn - engine;
   the turn includes the client serializing its request (shown apart as "client encode").
2. The HTTP stack: floor and added p50 at 1k under h11/asyncio, httptools/asyncio, httptools/uvloop.
3. Turns per second across 64 concurrent sessions over HTTP.
4. Proxies in front of an engine server, each in its own process (bench/servers.py): the client
   calls the fake engine's /v1/chat/completions directly, through `miles-env proxy serve --engine
   sglang` (render + tokenize the tail + record; ids to /generate) and through LiteLLM's proxy
   (forwards the messages; no tokenization). Added = via proxy - direct. Needs
   `bash scripts/install-litellm.sh`; `--no-litellm` skips it.
5. Per-turn added latency of the three dialects (bench_tito_dialects.py).

    python bench/bench_tito.py [--rounds 5] [--sessions 4] [--turns 20] [--no-litellm] [--only SECTIONS]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from bench_tito_dialects import dialect_rows, print_dialects
from servers import ADMIN_TOKEN, LITELLM_KEY, MODEL, fake_engine, litellm_proxy, litellm_version, tito_proxy

from miles_env.engines.base import SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.http import loop_options, serve_app
from miles_env.models import load_tokenizer
from miles_env.tito import TitoConfig, TitoProxy, create_app
from miles_env.tito.messages import ChatRequest, Message

ECHO = 8  # tokens the engine emits per turn
SIZES = (1000, 16000)
STACKS = (("h11", "asyncio"), ("httptools", "asyncio"), ("httptools", "uvloop"))
med = statistics.median


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def filler(tok: Any, n_tokens: int) -> str:
    unit = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    per = len(tok.encode(unit, add_special_tokens=False))
    return unit * max(1, n_tokens // per)


def chunks(tok: Any, target: int) -> list[str]:
    """User turns that grow a conversation to about `target` tokens."""
    size = min(1000, target // 4)
    return [filler(tok, size)] * (target // size)


class Chat:
    """One conversation through one chat-completions endpoint: post the history, keep the reply."""

    def __init__(self, http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> None:
        self.http, self.url, self.headers = http, url, headers
        self.msgs: list[dict[str, str]] = []
        self.tokens = 0
        self.own_overhead: list[float] = []  # LiteLLM's x-litellm-overhead-duration-ms, when sent
        self.encode: list[float] = []  # the client serializing its request (part of each turn's time)

    async def say(self, text: str) -> float:
        self.msgs.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        req = self.http.build_request(
            "POST", self.url, json={"model": MODEL, "messages": self.msgs}, headers=self.headers
        )
        self.encode.append(time.perf_counter() - t0)
        r = await self.http.send(req)
        dt = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        body = r.json()
        self.tokens = body["usage"]["total_tokens"]
        self.msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        if (own := r.headers.get("x-litellm-overhead-duration-ms")) is not None:
            self.own_overhead.append(float(own) / 1e3)
        return dt


def tito_chat(http: httpx.AsyncClient, base: str, sid: str, key: str) -> Chat:
    return Chat(http, f"{base}/s/{sid}/v1/chat/completions", {"x-api-key": key})


async def timed(n: int, call: Any) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t0)
    return lat


async def direct_turns(engine: ScriptedEngine, n_prompt: int, n: int) -> list[float]:
    ids = list(range(1000, 1000 + n_prompt))
    sp = SamplingParams(max_new_tokens=64, stop_token_ids=(2,))
    return await timed(n, lambda: engine.generate(ids, sp, session_id="x"))


async def core_turns(proxy: TitoProxy, sid: str, msgs: list[dict[str, str]], n: int) -> list[float]:
    conv = [Message(m["role"], m["content"]) for m in msgs]
    lat = []
    for i in range(n):
        conv.append(Message("user", f"ok {i}"))
        t0 = time.perf_counter()
        res = await proxy.chat(sid, ChatRequest(tuple(conv)))
        lat.append(time.perf_counter() - t0)
        conv.append(Message("assistant", res.text))
    return lat


async def grown(chat: Chat, tok: Any, target: int) -> Chat:
    for text in chunks(tok, target):
        await chat.say(text)
    return chat


async def inproc_round(tok: Any, turns: int, sessions: int, http_impl: str | None = None,
                       sizes: tuple[int, ...] = SIZES, full: bool = True) -> dict[int, dict[str, float]]:  # fmt: skip
    """One round of section 1 (or, with `full` off, section 2's floor and added p50) on a fresh server."""
    engine = ScriptedEngine(tok, echo_tokens=ECHO, max_context=65536, record=False)
    proxy = TitoProxy(engine, tok, TitoConfig())
    kw = {"http": http_impl} if http_impl else {}
    out: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as store:
        journaled = TitoProxy(engine, tok, TitoConfig(), store_dir=Path(store))
        async with serve_app(create_app(proxy), **kw) as url, httpx.AsyncClient(timeout=60) as http:
            for target in sizes:
                d50 = med(await direct_turns(engine, target, turns * sessions))
                via_http, encode, core, jrnl, floor, final = [], [], [], [], [], 0
                for _ in range(sessions):
                    h = proxy.create_session()
                    c = await grown(tito_chat(http, url, h.session_id, h.api_key), tok, target)
                    via_http += [await c.say(f"ok {i}") for i in range(turns)]
                    encode += c.encode[-turns:]
                    final = c.tokens
                    floor += await timed(turns, lambda: http.get(f"{url}/health"))
                    if not full:
                        continue
                    h2 = proxy.create_session()
                    c2 = await grown(tito_chat(http, url, h2.session_id, h2.api_key), tok, target)
                    core += await core_turns(proxy, h2.session_id, c2.msgs, turns)
                    h3 = journaled.create_session()
                    first = [Message("user", filler(tok, target))]
                    await journaled.chat(h3.session_id, ChatRequest(tuple(first)))
                    reply = journaled.renderer.decode(journaled.export(h3.session_id)[0].token_ids[-ECHO:-1])
                    msgs3 = [
                        {"role": "user", "content": first[0].content},
                        {"role": "assistant", "content": reply},
                    ]
                    jrnl += await core_turns(journaled, h3.session_id, msgs3, turns)
                out[target] = {"direct": d50, "floor": med(floor), "http": med(via_http), "encode": med(encode),
                               "added": med(via_http) - d50, "added90": pct(via_http, 0.9) - d50,
                               "final": final}  # fmt: skip
                if full:
                    out[target] |= {"core": med(core) - d50, "journal": med(jrnl) - d50}
    return out


async def throughput(tok: Any, n_sessions: int, turns: int) -> tuple[float, float]:
    engine = ScriptedEngine(tok, echo_tokens=ECHO, max_context=65536, record=False)
    proxy = TitoProxy(engine, tok, TitoConfig())
    limits = httpx.Limits(max_connections=n_sessions, max_keepalive_connections=n_sessions)
    async with serve_app(create_app(proxy)) as url, httpx.AsyncClient(timeout=120, limits=limits) as http:
        chats = [tito_chat(http, url, h.session_id, h.api_key) for h in (proxy.create_session() for _ in range(n_sessions))]  # fmt: skip

        async def one(c: Chat) -> None:
            for i in range(turns):
                await c.say(f"go {i}")

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c in chats:
                tg.start_soon(one, c)
        tps = n_sessions * turns / (time.perf_counter() - t0)

    async def direct(i: int) -> None:
        ids = list(range(1000, 1100))
        for _ in range(turns):
            gen = await engine.generate(ids, SamplingParams(max_new_tokens=64), session_id=str(i))
            ids = ids + gen.output_ids + [1, 2, 3]

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n_sessions):
            tg.start_soon(direct, i)
    return tps, n_sessions * turns / (time.perf_counter() - t0)


async def compare_round(
    urls: dict[str, str], tok: Any, turns: int, sessions: int
) -> dict[int, dict[str, float]]:
    """One round of section 4. One proxy at a time, its turns interleaved with direct ones, each
    against the direct turns of its own phase: LiteLLM keeps working after it answers (logging
    callbacks), which on 2 cores would otherwise slow whatever runs next."""
    out: dict[int, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for target in SIZES:
            out[target] = {}
            for proxy in ("tito", "litellm"):
                lat: dict[str, list[float]] = {"direct": [], proxy: []}
                own: list[float] = []
                for _ in range(sessions):
                    if proxy == "tito":
                        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
                        s = (await http.post(f"{urls['tito']}/admin/sessions", headers=auth)).json()
                        via = tito_chat(http, urls["tito"], s["session_id"], s["api_key"])
                    else:
                        auth = {"authorization": f"Bearer {LITELLM_KEY}"}
                        via = Chat(http, f"{urls['litellm']}/v1/chat/completions", auth)
                    chats = {"direct": Chat(http, f"{urls['engine']}/v1/chat/completions", {}), proxy: via}
                    for text in chunks(tok, target):
                        for c in chats.values():
                            await c.say(text)
                    for i in range(turns):
                        for name, c in chats.items():
                            lat[name].append(await c.say(f"ok {i}"))
                    own += via.own_overhead[-turns:]
                d = med(lat["direct"])
                out[target] |= {f"{proxy}_direct": d, proxy: med(lat[proxy]) - d}
                if own:
                    out[target]["litellm_own"] = med(own)
                await anyio.sleep(0.5)  # let LiteLLM's after-response work drain
    return out


def rounds_median(rounds: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    return {n: {k: med(r[n][k] for r in rounds) for k in rounds[0][n]} for n in rounds[0]}


def spread(rounds: list[dict[int, dict[str, float]]], n: int, k: str) -> str:
    xs = [r[n][k] * 1e3 for r in rounds]
    return f"{min(xs):.3f}-{max(xs):.3f}"


def installed(*names: str) -> bool:
    try:
        return all(md.version(n) for n in names)
    except md.PackageNotFoundError:
        return False


def section1(tok: Any, a: argparse.Namespace) -> None:
    runs = [
        anyio.run(inproc_round, tok, a.turns, a.sessions, backend_options=loop_options())
        for _ in range(a.rounds)
    ]
    m = rounds_median(runs)
    print("\n| history (tokens at end) | engine direct | core added | core + journal | HTTP floor (GET /health) "
          "| client encode | proxy p50 (HTTP) | added p50 (range over rounds) | added p90 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in m.items():
        print(f"| {n // 1000}k ({r['final']:.0f}) | {r['direct'] * 1e3:.3f} ms | {r['core'] * 1e3:.3f} ms "
              f"| {r['journal'] * 1e3:.3f} ms | {r['floor'] * 1e3:.3f} ms | {r['encode'] * 1e3:.3f} ms | {r['http'] * 1e3:.3f} ms "
              f"| **{r['added'] * 1e3:.3f} ms** ({spread(runs, n, 'added')}) | {r['added90'] * 1e3:.3f} ms |")  # fmt: skip
    lo, hi = m[SIZES[0]], m[SIZES[1]]
    print(f"\nadded p50 at 1k: {lo['added'] * 1e3:.3f} ms (target < 1 ms); 16k / 1k: "
          f"{hi['added'] / lo['added']:.2f}x (target <= 1.2x); core 16k / 1k: {hi['core'] / lo['core']:.2f}x")  # fmt: skip


def section2(tok: Any, a: argparse.Namespace) -> None:
    stacks = [(h, lp) for h, lp in STACKS if installed(h) and (lp != "uvloop" or installed("uvloop"))]
    runs: dict[tuple[str, str], list[dict[int, dict[str, float]]]] = {s: [] for s in stacks}
    for _ in range(a.rounds):
        for h, lp in stacks:
            opts = {"use_uvloop": lp == "uvloop"}
            runs[(h, lp)].append(anyio.run(inproc_round, tok, a.turns, a.sessions, h, SIZES[:1], False, backend_options=opts))  # fmt: skip
    print("\n| server stack (parser / loop) | HTTP floor p50 | added p50 at 1k |")
    print("|---|---|---|")
    base = rounds_median(runs[stacks[0]])[SIZES[0]]
    for s in stacks:
        r = rounds_median(runs[s])[SIZES[0]]
        print(f"| {s[0]} / {s[1]} | {r['floor'] * 1e3:.3f} ms ({r['floor'] / base['floor']:.2f}x) "
              f"| {r['added'] * 1e3:.3f} ms ({r['added'] / base['added']:.2f}x) |")  # fmt: skip


def section4(tok: Any, a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with (
            fake_engine(work, ECHO) as engine,
            tito_proxy(work, engine) as tito,
            litellm_proxy(work, engine) as ll,
        ):
            urls = {"engine": engine, "tito": tito, "litellm": ll}
            opts = loop_options()
            runs = [anyio.run(compare_round, urls, tok, a.turns, a.sessions, backend_options=opts) for _ in range(a.rounds)]  # fmt: skip
    m = rounds_median(runs)
    print(
        f"\nLiteLLM {litellm_version()} (litellm[proxy], own venv, 1 worker) vs `miles-env proxy serve --engine sglang`"
    )
    print("\n| history | engine direct (/v1/chat/completions; TITO phase / LiteLLM phase) | TITO added p50 "
          "| LiteLLM added p50 | LiteLLM's own x-litellm-overhead-duration-ms | TITO / LiteLLM |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for n, r in m.items():
        print(f"| {n // 1000}k | {r['tito_direct'] * 1e3:.3f} / {r['litellm_direct'] * 1e3:.3f} ms "
              f"| **{r['tito'] * 1e3:.3f} ms** ({spread(runs, n, 'tito')}) "
              f"| **{r['litellm'] * 1e3:.3f} ms** ({spread(runs, n, 'litellm')}) | {r['litellm_own'] * 1e3:.3f} ms "
              f"| **{r['tito'] / r['litellm']:.2f}x** |")  # fmt: skip


SECTIONS = ("inproc", "stack", "throughput", "litellm", "dialects")


def main(a: argparse.Namespace) -> None:
    tok = load_tokenizer()
    only = set(a.only.split(",")) if a.only else set(SECTIONS) - ({"litellm"} if a.no_litellm else set())
    versions = ", ".join(
        f"{n} {md.version(n)}" for n in ("uvicorn", "uvloop", "httptools", "starlette") if installed(n)
    )
    print(f"stack: {versions}; load average at start {os.getloadavg()[0]:.1f}")
    if "inproc" in only:
        section1(tok, a)
    if "stack" in only:
        section2(tok, a)
    if "throughput" in only:
        tps, base = anyio.run(throughput, tok, 64, a.turns, backend_options=loop_options())
        print(f"\n64 concurrent sessions over HTTP: {tps:.0f} turns/s ({ECHO} tokens per turn, client in the "
              f"same process); engine direct: {base:.0f} turns/s; proxy/direct {tps / base:.4f}")  # fmt: skip
    if "litellm" in only:
        section4(tok, a)
    if "dialects" in only:
        print_dialects(anyio.run(dialect_rows, tok, a.turns, a.sessions, backend_options=loop_options()))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM comparison")
    ap.add_argument("--only", default="", help=f"comma-separated sections: {','.join(SECTIONS)}")
    main(ap.parse_args())
