"""Benchmark of the local sandbox: create/exec/close latency against bare bwrap, then 32 at once.

Run: python bench/bench_sandbox.py [--iterations 60] [--concurrency 32]
Baselines, measured in the same run and spawned the same way (anyio.run_process):
  bare-same   : one `bwrap` call with exactly the sandbox's namespaces and mounts, running `true`
  bare-minimal: `bwrap --unshare-all --ro-bind /usr /usr (+ /lib symlinks) --proc --dev -- true`
Target: the whole create+exec+close cycle within 1.5x of a bare bwrap call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.local.config import host_root_binds

from miles_env.types import SandboxSpec


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def latency(provider: LocalSandboxProvider, iterations: int) -> dict[str, float]:
    probe = await provider.create(SandboxSpec())
    argv = probe._argv(["true"], None, None)
    bare_same = argv[argv.index(provider.bwrap) :]  # the probe stays open: its dirs are bound
    system = host_root_binds()
    links = [a for i in range(0, len(system), 3) if system[i] == "--symlink" for a in system[i : i + 3]]
    bare_min = [provider.bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr", *links]
    bare_min += ["--proc", "/proc", "--dev", "/dev", "--", "true"]
    samples: dict[str, list[float]] = {k: [] for k in ("create", "exec", "close", "cycle", "same", "minimal")}
    for _ in range(iterations):  # interleaved, so load from elsewhere hits every series alike
        t0 = time.perf_counter()
        sb = await provider.create(SandboxSpec())
        t1 = time.perf_counter()
        result = await sb.exec(["true"])
        t2 = time.perf_counter()
        await sb.close()
        t3 = time.perf_counter()
        assert result.exit_code == 0, result
        samples["create"].append(t1 - t0)
        samples["exec"].append(t2 - t1)
        samples["close"].append(t3 - t2)
        samples["cycle"].append(t3 - t0)
        for key, cmd in (("same", bare_same), ("minimal", bare_min)):
            t = time.perf_counter()
            await anyio.run_process(cmd)
            samples[key].append(time.perf_counter() - t)
    await probe.close()
    return {k: ms(v) for k, v in samples.items()}


async def concurrent(provider: LocalSandboxProvider, n: int) -> tuple[int, int, float]:
    ok = failed = 0

    async def one(i: int) -> None:
        nonlocal ok, failed
        try:
            async with await provider.create(SandboxSpec(files={"n.txt": str(i)})) as sb:
                r = await sb.exec("echo hi $(cat n.txt)", timeout=60)
            if r.exit_code == 0 and r.stdout == f"hi {i}\n":
                ok += 1
            else:
                failed += 1
        except Exception:
            failed += 1

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return ok, failed, time.perf_counter() - t


async def main(iterations: int, n: int, use_cgroup: bool) -> None:
    provider = LocalSandboxProvider(LocalSandboxConfig(use_cgroup=use_cgroup))
    print(f"root={provider.root} pids cgroup={'on' if use_cgroup else 'off'}")
    lat = await latency(provider, iterations)
    print(f"local sandbox latency, median of {iterations} (ms)")
    print(f"{'step':<28}{'ms':>8}")
    for key in ("create", "exec", "close", "cycle"):
        print(f"{key:<28}{lat[key]:>8.2f}")
    print(f"{'bare bwrap, same mounts':<28}{lat['same']:>8.2f}")
    print(f"{'bare bwrap, minimal':<28}{lat['minimal']:>8.2f}")
    print(f"cycle / bare (same mounts)  {lat['cycle'] / lat['same']:>8.2f}x   (target <= 1.5x)")
    print(f"cycle / bare (minimal)      {lat['cycle'] / lat['minimal']:>8.2f}x")
    ok, failed, wall = await concurrent(provider, n)
    print(f"\n{n} concurrent sandboxes (create, echo, close): ok={ok} failed={failed} wall={wall:.2f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--no-cgroup", action="store_true", help="measure without the pids cgroup")
    args = parser.parse_args()
    anyio.run(main, args.iterations, args.concurrency, not args.no_cgroup)
