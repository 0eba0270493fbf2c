"""Benchmark of the local sandbox: create/exec/close latency against bare bwrap, then 32 at once.

Run: python bench/bench_sandbox.py [--iterations 40] [--gap-ms 20] [--concurrency 32] [--repeat 1]
(as root the sandbox runs as its own uid; the baselines below tell that apart from bwrap as root).
`--repeat R` runs the latency part R times and reports the median of the runs' medians.
Baselines, measured in the same run, interleaved with the sandbox series:
  same        : one `bwrap` call with exactly the sandbox's flags, namespaces and mounts, running
                `true` as the sandbox's own unprivileged host uid (as root: `setpriv --reuid=<uid>
                --regid=<uid> --clear-groups`, as the provider's no-zygote path does), so the ratio
                isolates our wrapper; the ratios are against this one
  same-root   : the same call left as root (bwrap keeps its capabilities), for reference: what
                the "bare" baseline was before the sandbox dropped to its own uid (1d046ce)
  minimal     : `bwrap --unshare-all --ro-bind /usr /usr (+ /lib symlinks) --proc --dev -- true`
  setpriv     : `setpriv <same flags> -- true` against `true` alone: the uid drop's own exec, which
                `same` pays and the zygote path does not (it calls setresuid before exec'ing bwrap);
                "net" = same - (setpriv - true) estimates a bare call without it. (Dropping the uid
                in our own forked child instead costs more: CPython then forks this whole process
                rather than vfork.)
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
import shutil
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
    probe = await reuse.create(SandboxSpec())  # stays open: its dirs are bound by the bare calls
    bare_root = probe._bwrap_argv(["true"], None, None)
    drop = probe._drop_prefix  # as root: setpriv to the probe's uid; else empty (bwrap runs as us)
    true = shutil.which("true") or "/bin/true"
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
        "same": _bare_run([*drop, *bare_root]),
        "minimal": _bare_run(bare_min),
    }
    if drop:
        series |= {
            "same-root": _bare_run(bare_root),
            "setpriv": _bare_run([*drop, true]),
            "true": _bare_run([true]),
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


_ROWS = [
    ("cycle, zygote reused (default)", "reuse"),
    ("cycle, new zygote (warm=0)", "fresh"),
    ("cycle, no pids cgroup", "no-cg"),
    ("second exec on an open sandbox", "re-exec"),
    ("bare bwrap, same flags and uid", "same"),
    ("bare bwrap, same flags, as root", "same-root"),
    ("bare bwrap, minimal (as us)", "minimal"),
    ("setpriv <drop> -- true", "setpriv"),
    ("true", "true"),
]


def _with_net(lat: dict[str, float]) -> dict[str, float]:
    """Adds "net": the bare call less setpriv's own exec (same - (setpriv - true)), where measured."""
    if "setpriv" not in lat:
        return lat
    return lat | {"net": lat["same"] - (lat["setpriv"] - lat["true"])}


async def main(iterations: int, gap_ms: float, n: int, repeat: int) -> None:
    runs = [_with_net(await latency(iterations, gap_ms / 1000)) for _ in range(repeat)]

    def med(key: str, over: str | None = None) -> tuple[float, float, float]:
        """Median, min and max across runs of `key` (ms), or of its per-run ratio to `over`."""
        values = [r[key] / r[over] if over else r[key] for r in runs]
        return statistics.median(values), min(values), max(values)

    print(
        f"local sandbox latency, median of {iterations} interleaved rounds, {gap_ms:g} ms gap (ms); "
        f"{repeat} run(s): median of the runs' medians, ratio range across runs"
    )
    print(f"{'series':<34}{'ms':>8}{'/ bare':>9}  {'range':>13}")
    for label, key in _ROWS:
        if key in runs[0]:
            (ms_, _, _), (ratio, lo, hi) = med(key), med(key, "same")
            print(f"{label:<34}{ms_:>8.2f}{ratio:>8.2f}x  {lo:>5.2f}-{hi:.2f}x")
    print("target: cycle / bare (same flags and uid) <= 1.5x")
    if "net" in runs[0]:
        (net, _, _), (ratio, lo, hi) = med("net"), med("reuse", "net")
        print(f"bare net of setpriv's exec: {net:.2f} ms; cycle / that: {ratio:.2f}x ({lo:.2f}-{hi:.2f}x)")
    parts = ", ".join(f"{k} {med(k)[0]:.2f} ms" for k in ("create", "exec", "close"))
    print(f"default cycle in parts: {parts}")
    ok, failed, wall = await concurrent(n)
    print(f"\n{n} concurrent sandboxes (create, echo, close): ok={ok} failed={failed} wall={wall:.2f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle time before each measured call")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1, help="whole latency runs (noisy machine)")
    args = parser.parse_args()
    anyio.run(main, args.iterations, args.gap_ms, args.concurrency, args.repeat)
