"""Benchmark of the local sandbox: create/exec/close latency against bare bwrap, then 32 at once.

Run: python bench/bench_sandbox.py [--iterations 40] [--gap-ms 20] [--concurrency 32]
Baselines, measured in the same run, interleaved with the sandbox series:
  bare-same   : one `bwrap` call with exactly the sandbox's namespaces and mounts, running `true`
  bare-minimal: `bwrap --unshare-all --ro-bind /usr /usr (+ /lib symlinks) --proc --dev -- true`
Series (each: create, exec `true`, close):
  reuse   : the default provider: create takes the zygote + pids cgroup a closed sandbox gave back
  fresh   : warm=0: every create starts a zygote, which joins a new cgroup (the one join)
  no-cg   : use_cgroup=False: no zygote, no pids cgroup (RLIMIT_NPROC only; does not bind root)
  re-exec : a second exec on an open sandbox
Before the zygote (commit b89921f and earlier) each exec joined the cgroup itself.
`--gap-ms` sleeps before every measured call, as an agent's think time would: joining a cgroup
waits for an RCU grace period, which is short only while other joins keep it warm.
Target: the whole create+exec+close cycle within 1.5x of a bare bwrap call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.local.config import host_root_binds
from miles_env.sandboxes.local.process import run_capped

from miles_env.types import SandboxSpec


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def _bare_run(argv: list[str]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:  # spawned and collected exactly as the sandbox's own execs are
        raw = await run_capped(argv, stdin=None, timeout=60, output_cap=1 << 20)
        assert raw.returncode == 0, raw

    return run


async def latency(iterations: int, gap_s: float) -> dict[str, float]:
    reuse = LocalSandboxProvider(LocalSandboxConfig())
    fresh = LocalSandboxProvider(LocalSandboxConfig(warm=0))
    no_cg = LocalSandboxProvider(LocalSandboxConfig(use_cgroup=False))
    probe = await reuse.create(SandboxSpec())  # stays open: its dirs are bound by bare-same
    argv = probe._argv(["true"], None, None)
    bare_same = argv[argv.index(reuse.bwrap) :]
    system = host_root_binds()
    links = [a for i in range(0, len(system), 3) if system[i] == "--symlink" for a in system[i : i + 3]]
    bare_min = [reuse.bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr", *links]
    bare_min += ["--proc", "/proc", "--dev", "/dev", "--", "true"]

    parts: dict[str, list[float]] = {"create": [], "exec": [], "close": []}

    def cycle(provider: LocalSandboxProvider, record: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            t0 = time.perf_counter()
            sb = await provider.create(SandboxSpec())
            t1 = time.perf_counter()
            result = await sb.exec(["true"])
            t2 = time.perf_counter()
            await sb.close()
            t3 = time.perf_counter()
            assert result.exit_code == 0, result
            if record:
                for key, dt in (("create", t1 - t0), ("exec", t2 - t1), ("close", t3 - t2)):
                    parts[key].append(dt)

        return run

    async def re_exec() -> None:
        assert (await probe.exec(["true"])).exit_code == 0

    series: dict[str, Callable[[], Awaitable[None]]] = {
        "reuse": cycle(reuse, record=True),
        "fresh": cycle(fresh),
        "no-cg": cycle(no_cg),
        "re-exec": re_exec,
        "same": _bare_run(bare_same),
        "minimal": _bare_run(bare_min),
    }
    await cycle(reuse)()  # leaves an idle zygote, as any earlier sandbox of a run does
    await re_exec()
    samples: dict[str, list[float]] = {k: [] for k in series}
    for _ in range(iterations):  # interleaved, so load from elsewhere hits every series alike
        for key, run in series.items():
            await anyio.sleep(gap_s)
            t = time.perf_counter()
            await run()
            samples[key].append(time.perf_counter() - t)
    await probe.close()
    for provider in (reuse, fresh, no_cg):
        await provider.aclose()
    return {k: ms(v) for k, v in (samples | parts).items()}


async def concurrent(n: int) -> tuple[int, int, float]:
    provider = LocalSandboxProvider(LocalSandboxConfig())
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
    wall = time.perf_counter() - t
    await provider.aclose()
    return ok, failed, wall


async def main(iterations: int, gap_ms: float, n: int) -> None:
    lat = await latency(iterations, gap_ms / 1000)
    print(f"local sandbox latency, median of {iterations} interleaved rounds, {gap_ms:g} ms gap (ms)")
    print(f"{'series':<34}{'ms':>8}{'/ bare':>9}")
    rows = [
        ("cycle, zygote reused (default)", "reuse"),
        ("cycle, new zygote (warm=0)", "fresh"),
        ("cycle, no pids cgroup", "no-cg"),
        ("second exec on an open sandbox", "re-exec"),
        ("bare bwrap, same mounts", "same"),
        ("bare bwrap, minimal", "minimal"),
    ]
    for label, key in rows:
        print(f"{label:<34}{lat[key]:>8.2f}{lat[key] / lat['same']:>8.2f}x")
    print("target: cycle / bare (same mounts) <= 1.5x")
    print("default cycle in parts: " + ", ".join(f"{k} {lat[k]:.2f} ms" for k in ("create", "exec", "close")))
    ok, failed, wall = await concurrent(n)
    print(f"\n{n} concurrent sandboxes (create, echo, close): ok={ok} failed={failed} wall={wall:.2f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle time before each measured call")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    anyio.run(main, args.iterations, args.gap_ms, args.concurrency)
