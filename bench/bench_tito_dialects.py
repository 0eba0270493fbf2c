"""Per-turn added latency of TITO's three dialects (chat completions, Responses, Anthropic Messages).

Same conversation in every dialect (official wire shapes over HTTP, non-streaming), turns
interleaved across the dialects so machine load hits all three alike; figures are the p50 of a
turn minus the engine called directly. Run by bench/bench_tito.py (`--only dialects` runs just this).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx

from miles_env.engines.base import SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.http import serve_app
from miles_env.tito import TitoConfig, TitoProxy, create_app

ECHO = 8


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


def _filler(tok: Any, n_tokens: int) -> str:
    unit = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    return unit * max(1, n_tokens // len(tok.encode(unit, add_special_tokens=False)))


async def dialect_rows(tok: Any, turns: int, sessions: int) -> dict[int, dict[str, float]]:
    engine = ScriptedEngine(tok, echo_tokens=ECHO, max_context=65536, record=False)
    ids, sp = list(range(1000, 2000)), SamplingParams(max_new_tokens=64, stop_token_ids=(2,))
    direct = []
    for _ in range(200):
        t0 = time.perf_counter()
        await engine.generate(ids, sp, session_id="x")
        direct.append(time.perf_counter() - t0)
    d50 = statistics.median(direct)
    proxy = TitoProxy(engine, tok, TitoConfig())
    rows = {}
    async with serve_app(create_app(proxy)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def turn(d: Dialect, h: Any, hist: list[dict], text: str) -> float:
            hist.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            r = await http.post(
                f"/s/{h.session_id}{d.path}", json=d.body(hist), headers={"x-api-key": h.api_key}
            )
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            hist += d.reply(r.json())
            return dt

        for target in (1000, 16000):
            lat: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
            chunk = _filler(tok, min(1000, target // 4))
            for _ in range(sessions):
                state = [(d, proxy.create_session(), []) for d in DIALECTS]
                for _ in range(max(1, target // min(1000, target // 4) - 1)):  # same history everywhere
                    for d, h, hist in state:
                        await turn(d, h, hist, chunk)
                for i in range(turns):
                    for d, h, hist in state:
                        lat[d.name].append(await turn(d, h, hist, f"ok {i}"))
            rows[target] = {k: statistics.median(v) - d50 for k, v in lat.items()}
    return rows


def print_dialects(rows: dict[int, dict[str, float]]) -> None:
    print("\n| history (tokens) | chat completions p50 | Responses p50 | Messages p50 | Responses / chat | Messages / chat |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for n, r in rows.items():
        c, o, m = r["chat"], r["responses"], r["messages"]
        print(f"| {n // 1000}k | {c * 1e3:.3f} ms | {o * 1e3:.3f} ms | {m * 1e3:.3f} ms | **{o / c:.2f}x** | **{m / c:.2f}x** |")  # fmt: skip
    print("added per-turn latency over the engine called directly (p50); target: ratios <= 1.5x")
