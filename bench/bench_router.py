"""Per-turn latency added by SGLang's router (sglang-router) in front of two engines, against direct access.

Two scripted engines (tests/scripted_server.py: the embedded SGLang server over a ScriptedEngine,
zero model cost, each in its own process) serve multi-turn sessions; the same SGLangEngine client
code reaches them either directly (our consistent-hash ring picks the engine) or through the
router (`engine.router: sglang-router`, policy manual on X-SMG-Routing-Key). Rounds alternate
between the two paths with fresh session ids, so both see the same machine load; a turn's latency
is `generate()`'s wall time in the client. The prefix-cache hit rate of each path shows both keep
every session on one engine.

    python bench/bench_router.py [--sessions 16] [--turns 8] [--prompt 1024] [--concurrency 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from miles_env.engines.base import PrefixCacheStats, SamplingParams
from miles_env.engines.router import start_router
from miles_env.engines.sglang import SGLangEngine
from miles_env.http import free_port, loop_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from scripted_server import ScriptedServer  # noqa: E402

__all__ = ["main"]

SAMPLING = SamplingParams(max_new_tokens=16)


async def _workload(client: SGLangEngine, tag: str, a: argparse.Namespace) -> list[float]:
    """`sessions` sessions of `turns` turns, `concurrency` sessions in flight; per-turn seconds."""
    lat: list[float] = []
    limiter = anyio.CapacityLimiter(a.concurrency)

    async def session(i: int) -> None:
        async with limiter:
            ids = [1 + (j * 7919 + i) % 30000 for j in range(a.prompt)]
            for _ in range(a.turns):
                t0 = time.perf_counter()
                gen = await client.generate(ids, SAMPLING, session_id=f"{tag}-{i}")
                lat.append(time.perf_counter() - t0)
                ids = [*ids, *gen.output_ids, *range(200, 232)]  # the next user message: 32 tokens

    async with anyio.create_task_group() as tg:
        for i in range(a.sessions):
            tg.start_soon(session, i)
    return lat


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


async def _run(a: argparse.Namespace) -> None:
    servers = [ScriptedServer(free_port()) for _ in range(2)]
    urls = [s.url for s in servers]
    router = await start_router(urls, free_port(), Path(tempfile.mkdtemp()) / "router.log")
    direct = SGLangEngine(urls)
    routed = SGLangEngine(urls, router=router.spec.url)
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    try:
        for client in (direct, routed):  # warm-up: connections, the servers' first requests
            await _workload(client, "warm", argparse.Namespace(**{**vars(a), "sessions": 2, "turns": 2}))
        base = {"direct": direct.prefix_cache_stats(), "router": routed.prefix_cache_stats()}
        for r in range(a.rounds):
            for name, client in (("direct", direct), ("router", routed)):
                lat[name] += await _workload(client, f"{name}{r}", a)
        hits = {"direct": direct.prefix_cache_stats() - base["direct"], "router": routed.prefix_cache_stats()}
        hits["router"] = hits["router"] - base["router"]
        _report(a, lat, hits)
    finally:
        await direct.close()
        await routed.close()
        await router.stop()
        for s in servers:
            s.kill()


def _report(a: argparse.Namespace, lat: dict[str, list[float]], hits: dict[str, PrefixCacheStats]) -> None:
    print(
        f"{a.sessions} sessions x {a.turns} turns, prompt {a.prompt} tokens (+ reply + 32 per turn), "
        f"concurrency {a.concurrency}, {a.rounds} rounds, {len(lat['direct'])} turns per path"
    )
    print("| path | p50 ms | p99 ms | mean ms | prefix-cache hit rate |")
    print("|---|---:|---:|---:|---:|")
    for name in ("direct", "router"):
        xs = lat[name]
        print(
            f"| {name} | {_pct(xs, 0.5):.2f} | {_pct(xs, 0.99):.2f} | {statistics.fmean(xs) * 1e3:.2f} "
            f"| {hits[name].hit_rate:.3f} |"
        )
    d, r = lat["direct"], lat["router"]
    print(
        f"added by the router: p50 {_pct(r, 0.5) - _pct(d, 0.5):+.2f} ms, p99 {_pct(r, 0.99) - _pct(d, 0.99):+.2f} ms, "
        f"mean {(statistics.fmean(r) - statistics.fmean(d)) * 1e3:+.2f} ms; "
        f"ratio router/direct p50 {_pct(r, 0.5) / _pct(d, 0.5):.2f}x, p99 {_pct(r, 0.99) / _pct(d, 0.99):.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024, help="first prompt's tokens")
    ap.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    ap.add_argument("--rounds", type=int, default=5)
    anyio.run(_run, ap.parse_args(), backend_options=loop_options())


if __name__ == "__main__":
    main()
