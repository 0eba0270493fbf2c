"""Create, exec and close latency per sandbox provider that runs here, and warm-pool acquire latency.

Run: python bench/bench_providers.py [--iterations 20] [--providers local,docker]
Baseline (measured in the same run): the local provider. For each provider, the
median of `iterations` interleaved cycles of create -> exec(["true"]) -> close;
then, through a SandboxPool(warm=4) over the same provider, the latency of
create() when a warm sandbox is ready, against a cold create().
docker needs a running engine (scripts/start-dockerd.sh); it is left out, with
the reason printed, when none answers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio

from miles_env.errors import SandboxError
from miles_env.sandboxes import get_provider
from miles_env.sandboxes.pool import SandboxPool
from miles_env.types import SandboxSpec


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def cycle(provider: Any) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    sb = await provider.create(SandboxSpec())
    t1 = time.perf_counter()
    result = await sb.exec(["true"])
    t2 = time.perf_counter()
    await sb.close()
    t3 = time.perf_counter()
    assert result.ok, result
    return t1 - t0, t2 - t1, t3 - t2


async def warm_vs_cold(provider: Any, iterations: int) -> tuple[float, float]:
    spec = SandboxSpec()
    warm: list[float] = []
    async with SandboxPool(provider, warm=4) as pool:
        await pool.prewarm(spec)
        for _ in range(iterations):
            with anyio.fail_after(120):
                while not pool._warm[spec.model_dump_json()]:  # wait for the refill: measure a warm hit
                    await anyio.sleep(0.005)
            t = time.perf_counter()
            sb = await pool.create(spec)
            warm.append(time.perf_counter() - t)
            await sb.close()
        assert pool.stats.warm_hits == iterations
    cold: list[float] = []
    for _ in range(iterations):
        t = time.perf_counter()
        sb = await provider.create(spec)
        cold.append(time.perf_counter() - t)
        await sb.close()
    return ms(warm), ms(cold)


async def main(iterations: int, names: list[str]) -> None:
    providers: dict[str, Any] = {}
    for name in names:
        try:
            p = get_provider(name)
            if hasattr(p, "ping"):
                await p.ping()
            await cycle(p)  # warm-up (image cache, cgroup dirs)
            providers[name] = p
        except SandboxError as e:
            print(f"# {name}: left out: {e}", file=sys.stderr)
    samples: dict[str, list[tuple[float, float, float]]] = {n: [] for n in providers}
    for _ in range(iterations):  # interleaved, so load from elsewhere hits every provider alike
        for name, p in providers.items():
            samples[name].append(await cycle(p))
    base = sum(ms([s[i] for s in samples["local"]]) for i in range(3)) if "local" in samples else None
    print(f"iterations={iterations} (median ms)")
    print(f"{'provider':<10} {'create':>9} {'exec':>9} {'close':>9} {'cycle':>9} {'vs local':>9}")
    for name, rows in samples.items():
        c, e, x = (ms([r[i] for r in rows]) for i in range(3))
        ratio = f"{(c + e + x) / base:.1f}x" if base else "-"
        print(f"{name:<10} {c:9.2f} {e:9.2f} {x:9.2f} {c + e + x:9.2f} {ratio:>9}")
    print()
    print(f"{'provider':<10} {'warm acquire':>13} {'cold create':>12} {'speedup':>8}")
    for name, p in providers.items():
        warm, cold = await warm_vs_cold(p, max(5, iterations // 2))
        print(f"{name:<10} {warm:13.3f} {cold:12.2f} {cold / warm:7.0f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--providers", default="local,docker")
    args = parser.parse_args()
    anyio.run(main, args.iterations, args.providers.split(","))
