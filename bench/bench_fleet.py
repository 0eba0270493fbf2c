"""Benchmark of the fleet controller (sandboxes/fleet.py): 64 concurrent creations on the local
provider, with and without it.

Run: python bench/bench_fleet.py [--n 64] [--rounds 5] [--rate 30]
Series, each a round of `n` concurrent `create()` calls on one provider (then every sandbox
closed, outside the timing), interleaved round by round:
  bare        : LocalSandboxProvider alone: the baseline the ratios are against
  fleet       : the default FleetProvider (no rate limit, max_starting 32): its own overhead
  fleet-cap8  : max_starting=8: creations queue for a starting slot
  fleet-rate  : create_rate_per_s=--rate, burst 8, through the machine-wide file bucket: the start
                rate must come out at the configured one: 8 at once, then 1/rate apart, so a
                round of n takes (n - 8) / rate seconds (printed as "expected")
Per series: start rate (creations per second of the round's wall time) and p50 / p99 create
latency (from the round's start, when all `n` are asked for, to each one's return: time spent
waiting for a token, a slot or the event loop counts), the median over rounds, and ratios
against `bare`. Also the cost of one file-bucket take (µs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.sandboxes.buckets import FileBucket
from miles_env.sandboxes.fleet import FleetProvider
from miles_env.sandboxes.fleet_config import FleetConfig
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.types import SandboxSpec


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_round(provider: SandboxProvider, n: int) -> tuple[float, list[float]]:
    made: list[Sandbox] = []
    latencies: list[float] = []  # from the round's start: all n are asked for at once

    async def create() -> None:
        made.append(await provider.create(SandboxSpec()))
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(create)
    wall = time.perf_counter() - t0
    for sb in made:
        await sb.close()
    return n / wall, latencies


async def main(n: int, rounds: int, rate: float, root: Path) -> dict[str, dict[str, float]]:
    local = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(root / "sb")))
    series: dict[str, SandboxProvider] = {
        "bare": local,
        "fleet": FleetProvider(local, FleetConfig()),
        "fleet-cap8": FleetProvider(local, FleetConfig(max_starting=8)),
        "fleet-rate": FleetProvider(
            local,
            FleetConfig(create_rate_per_s=rate, burst=8),
            bucket=FileBucket(root / "local.bucket", rate, 8),
        ),
    }
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in series}
    await one_round(local, n)  # warm-up: zygotes, caches
    for _ in range(rounds):
        for name, provider in series.items():
            per_s, lat = await one_round(provider, n)
            runs[name].append((per_s, p(lat, 0.5), p(lat, 0.99)))
    await local.aclose()
    return {
        name: {
            "rate": statistics.median(r[0] for r in rs),
            "p50_ms": statistics.median(r[1] for r in rs) * 1000,
            "p99_ms": statistics.median(r[2] for r in rs) * 1000,
        }
        for name, rs in runs.items()
    }


def bucket_take_us(root: Path, takes: int = 2000) -> float:
    bucket = FileBucket(root / "speed.bucket", 1e9, 1 << 30)
    t0 = time.perf_counter()
    for i in range(takes):
        bucket.try_take(float(i))
    return (time.perf_counter() - t0) / takes * 1e6


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=30.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = anyio.run(main, args.n, args.rounds, args.rate, Path(tmp))
        take = bucket_take_us(Path(tmp))
    base = out["bare"]
    print(f"{args.n} concurrent creations, local provider, median of {args.rounds} rounds")
    print("| series | starts/s | ratio | p50 create ms | p99 create ms | p99 ratio |")
    print("|---|---|---|---|---|---|")
    for name, r in out.items():
        print(
            f"| {name} | {r['rate']:.0f} | {r['rate'] / base['rate']:.2f}x | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['p99_ms'] / base['p99_ms']:.2f}x |"
        )
    expected = args.n / ((args.n - 8) / args.rate)
    print(f"fleet-rate expected at most {expected:.0f} starts/s (create_rate_per_s={args.rate:g}, burst 8)")
    print(f"file bucket: {take:.1f} us per take (flock + read + write)")
