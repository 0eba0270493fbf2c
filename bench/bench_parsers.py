"""Per-turn TITO proxy overhead with each model family's parsers at ~1k tokens of history (issue 16).

Each family (tests/tito_families.py: its chat template over SmolLM2's vocabulary plus its special
tokens) gets a journaled TitoProxy over a zero-cost scripted engine whose every reply is the family's
native reasoning + tool call, pre-tokenized, so the engine costs only a queue pop. A session opens
on a ~1k-token user message; each measured turn then sends the history back with the last call's
tool result, and the proxy stitches the tail onto the stored ids, calls the engine, runs the
family's reasoning and tool parsers, serializes the chat-completions body (json.dumps) and journals
the turn. Overhead = the turn's wall time minus the time spent inside `engine.generate`.

Families alternate inside a round (rounds x sessions x turns; the order rotates from round to round,
so no family always runs first) so machine load hits them alike; each
figure is the median over rounds of a per-round median (p90 likewise); the ratio is to the hermes
path (the qwen3 family: hermes + think) of the same round. "parse" is `Parsers.parse` alone on the
reply text. Every session must stay one stitched branch (checked), else a family would be
measured on full re-renders. Each family also runs, in the same rounds, with a zero-cost parser
(`Canned`: the parse of the reply computed once, fresh call ids each turn): what its template,
stitching, serialization and journal cost without the parser, so a gap is attributed.

    python bench/bench_parsers.py [--rounds 32] [--sessions 2] [--turns 10] [--history 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_tito import filler, pct  # noqa: E402

from miles_env.engines.base import Generation, SamplingParams  # noqa: E402
from miles_env.http import loop_options  # noqa: E402
from miles_env.tito import TitoConfig, TitoProxy  # noqa: E402
from miles_env.tito.messages import (  # noqa: E402
    ChatRequest,
    ChatResult,
    Message,
    ToolCall,  # noqa: E402
)
from miles_env.tito.openai_chat import completion_body  # noqa: E402
from miles_env.tito.parsers import Parsed, Parsers, reasoning_of  # noqa: E402
from tests.tito_families import FAMILIES, Family, FamilyEngine  # noqa: E402
from tests.tito_support import TOOLS  # noqa: E402

__all__ = ["main"]

BASELINE = "qwen3"  # the hermes path: hermes tool parser + think reasoning
FILES = "a.txt\nb.txt"
med = statistics.median


class TimedEngine(FamilyEngine):
    """A FamilyEngine that adds up the time spent inside `generate`, to subtract from a turn."""

    spent = 0.0

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        t0 = time.perf_counter()
        try:
            return await super().generate(input_ids, sampling, session_id=session_id)
        finally:
            self.spent += time.perf_counter() - t0


class Canned:
    """A zero-cost stand-in for a family's Parsers: the reply's parse computed once, new call ids."""

    def __init__(self, parsers: Parsers, text: str) -> None:
        self.tool, self.reasoning = parsers.tool, parsers.reasoning
        self.res = parsers.parse(text, tuple(TOOLS))
        self.n = 0

    def parse(self, text: str, tools: tuple[dict[str, Any], ...]) -> Parsed:
        self.n += 1
        calls = tuple(
            ToolCall(f"call_{self.n}_{i}", c.name, c.arguments) for i, c in enumerate(self.res.tool_calls)
        )
        return Parsed(self.res.content, calls, self.res.reasoning)


@dataclass(frozen=True)
class Bench:
    """One family's proxy, engine, pre-tokenized reply and the ~1k-token opening message."""

    key: str  # the family's name, "+ zero-cost parser" for the control
    family: Family
    proxy: TitoProxy
    engine: TimedEngine
    reply: tuple[int, ...]
    opening: str


def build(family: Family, store: Path, history: int, canned: bool = False) -> Bench:
    tok = family.tokenizer()
    stop = tok.convert_tokens_to_ids(family.stop)
    reply = (*tok.encode(family.call, add_special_tokens=False), stop)
    eos = tok.convert_tokens_to_ids(list(family.eos))
    engine = TimedEngine(tok, stop_token=family.stop, eos=eos, record=False, max_context=65536)
    proxy = TitoProxy(engine, tok, TitoConfig(stop_token=family.stop), store_dir=store)
    assert (proxy.parsers.tool, proxy.parsers.reasoning) == (family.parser, family.reasoning), family.name
    if canned:
        proxy.parsers = Canned(proxy.parsers, family.call)  # type: ignore[assignment]
    key = f"{family.name} + zero-cost parser" if canned else family.name
    return Bench(key, family, proxy, engine, reply, filler(tok, history))


def answered(res: ChatResult) -> list[Message]:
    """The assistant turn as a client sends it back, and the tool result of its (first) call."""
    r = reasoning_of(res)
    back = Message("assistant", res.content or "", res.tool_calls, reasoning=r.text if r else None)
    assert res.tool_calls, f"no tool call parsed: {res.text!r}"
    return [back, Message("tool", FILES, tool_call_id=res.tool_calls[0].id)]


async def session(b: Bench, turns: int) -> tuple[list[float], int]:
    """One session: an untimed opening turn, then `turns` timed ones; (overheads, final prompt tokens)."""
    h = b.proxy.create_session()
    sid = h.session_id

    def respond(res: ChatResult) -> tuple[ChatResult, str]:
        return res, json.dumps(completion_body(res, "policy"))

    conv = [Message("system", "You are terse."), Message("user", b.opening)]
    out: list[float] = []
    res: ChatResult | None = None
    for i in range(turns + 1):
        b.engine.push(b.reply, session_id=sid)
        req = ChatRequest(tuple(conv), tools=tuple(TOOLS))
        spent0, t0 = b.engine.spent, time.perf_counter()
        res, _ = await b.proxy.serve(sid, req, respond)
        dt = time.perf_counter() - t0 - (b.engine.spent - spent0)
        if i:
            out.append(dt)
        conv += answered(res)
    assert res is not None
    assert len(b.proxy.export(sid)) == 1, f"{b.family.name}: a turn did not stitch onto the stored ids"
    b.proxy.close_session(sid)
    return out, res.prompt_tokens


def parse_time(b: Bench, n: int = 200) -> float:
    text = b.family.call
    tools = tuple(TOOLS)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        b.proxy.parsers.parse(text, tools)
        lat.append(time.perf_counter() - t0)
    return med(lat)


async def one_round(
    benches: list[Bench], sessions: int, turns: int, shift: int = 0
) -> dict[str, dict[str, float]]:
    lat: dict[str, list[float]] = {b.key: [] for b in benches}
    final: dict[str, int] = {}
    order = benches[shift % len(benches) :] + benches[: shift % len(benches)]  # no family always first
    for _ in range(sessions):  # families interleaved session by session
        for b in order:
            xs, final[b.key] = await session(b, turns)
            lat[b.key] += xs
    return {
        b.key: {
            "p50": med(lat[b.key]),
            "p90": pct(lat[b.key], 0.9),
            "parse": parse_time(b),
            "final": final[b.key],
        }
        for b in benches
    }


def table(runs: list[dict[str, dict[str, float]]], benches: list[Bench]) -> list[str]:
    rows = [
        "| family | tool / reasoning parser | prompt tokens at end | parse alone | overhead p50 (range) "
        "| overhead p90 | p50 / hermes (range over rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for b in benches:
        name = b.key
        p50 = [r[name]["p50"] for r in runs]
        base = BASELINE if name == b.family.name else f"{BASELINE} + zero-cost parser"  # like for like
        ratios = [r[name]["p50"] / r[base]["p50"] for r in runs]
        worst = max(worst, med(ratios)) if name == b.family.name else worst
        rows.append(
            f"| {name} | {b.family.parser} / {b.family.reasoning} | {runs[-1][name]['final']:.0f} "
            f"| {med(r[name]['parse'] for r in runs) * 1e6:.0f} us "
            f"| **{med(p50) * 1e3:.3f} ms** ({min(p50) * 1e3:.3f}-{max(p50) * 1e3:.3f}) "
            f"| {med(r[name]['p90'] for r in runs) * 1e3:.3f} ms "
            f"| **{med(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    rows.append(f"\nworst family / hermes: {worst:.2f}x (target <= 1.2x)")
    return rows


def main(a: argparse.Namespace) -> None:
    print(f"load average at start {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        benches = [
            build(f, Path(tmp) / f"{f.name}{'-canned' if c else ''}", a.history, c)
            for f in FAMILIES
            for c in (False, True)
        ]
        anyio.run(one_round, benches, 1, 2, backend_options=loop_options())  # warm-up
        runs = [
            anyio.run(one_round, benches, a.sessions, a.turns, i, backend_options=loop_options())
            for i in range(a.rounds)
        ]
    print("\n".join(table(runs, benches)))
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=32)  # two rotations of the order
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--history", type=int, default=1000, help="tokens of the opening user message")
    main(ap.parse_args())
