"""Benchmark of the local sandbox against the previous design, both measured in the same run.

Run: python bench/bench_sandbox.py [--baseline a0c6b9f] [--iterations 40] [--gap-ms 20] [--repeat 1]
(as root, as CI runs it; needs the repository's git history for the baseline).

Baseline ("before"): the local provider as of `--baseline` (default a0c6b9f, the last commit with a
fresh `bwrap --unshare-all` per exec, read-only host root, processes dying with each exec), loaded
from git into a private package beside the current one, so both run in this process, interleaved.
Now ("after"): one long-lived bwrap per sandbox, each exec a zygote fork that enters it.
Series, each a median of interleaved rounds (`--gap-ms` of idle before each, as an agent's think
time would; cgroup joins are slower after idle):
  cycle host   : create + exec `true` + close, the host's view, zygote reused (the default), before / after
  cycle image  : the same with an image root filesystem (tests/rootfs_support's: dash, coreutils, a
                 non-root USER), after only: the target is <= 1.5x the host-root cycle before
  cycle fresh  : warm=0: every create starts a zygote (a python start and the one cgroup join)
  exec         : one more `true` on an open sandbox, before / after
  exec, busy   : after, with a background process left running by an earlier exec (a server)
Then 32 sandboxes at once (create, `echo hi $(cat n.txt)`, close), before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.types import SandboxSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from rootfs_support import IMAGE, ImageProvider, build_rootfs  # noqa: E402


def load_baseline(rev: str, into: Path) -> Any:
    """The local provider package at git `rev`, as miles_env.sandboxes._baseline_local."""
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "sandboxes/local/"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    pkg = into / "_baseline_local"
    pkg.mkdir()
    for name in names:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{name}"], capture_output=True, check=True
        )
        (pkg / Path(name).name).write_bytes(text.stdout)
    spec = importlib.util.spec_from_file_location(
        "miles_env.sandboxes._baseline_local", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def cycle(provider: Any, spec: SandboxSpec) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        sb = await provider.create(spec)
        try:
            assert (await sb.exec(["true"])).exit_code == 0
        finally:
            await sb.close()

    return run


def exec_on(sb: Any) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        assert (await sb.exec(["true"])).exit_code == 0

    return run


async def latency(old: types.ModuleType, rootfs: str, iterations: int, gap_s: float) -> dict[str, float]:
    old_reuse = old.LocalSandboxProvider(old.LocalSandboxConfig())
    old_fresh = old.LocalSandboxProvider(old.LocalSandboxConfig(warm=0))
    new_reuse = ImageProvider(LocalSandboxConfig(), {rootfs: IMAGE})
    new_fresh = LocalSandboxProvider(LocalSandboxConfig(warm=0))
    host, image = SandboxSpec(), SandboxSpec(rootfs=rootfs)
    old_open, new_open, busy = (
        await old_reuse.create(host),
        await new_reuse.create(host),
        await new_reuse.create(host),
    )
    assert (await busy.exec("sleep 3600 > /dev/null 2>&1 &")).ok  # a server left running
    series: dict[str, Callable[[], Awaitable[None]]] = {
        "cycle host before": cycle(old_reuse, host),
        "cycle host after": cycle(new_reuse, host),
        "cycle image after": cycle(new_reuse, image),
        "cycle fresh before": cycle(old_fresh, host),
        "cycle fresh after": cycle(new_fresh, host),
        "exec before": exec_on(old_open),
        "exec after": exec_on(new_open),
        "exec busy after": exec_on(busy),
    }
    for run in series.values():  # leaves idle zygotes, as any earlier sandbox of a run does
        await run()
    samples: dict[str, list[float]] = {k: [] for k in series}
    for _ in range(iterations):  # interleaved, so load from elsewhere hits every series alike
        for key, run in series.items():
            await anyio.sleep(gap_s)
            t = time.perf_counter()
            await run()
            samples[key].append(time.perf_counter() - t)
    for sb in (old_open, new_open, busy):
        await sb.close()
    for provider in (old_reuse, old_fresh, new_reuse, new_fresh):
        await provider.aclose()
    return {k: ms(v) for k, v in samples.items()}


async def concurrent(provider: Any, n: int) -> tuple[int, int, float]:
    ok = failed = 0

    async def one(i: int) -> None:
        nonlocal ok, failed
        try:
            async with await provider.create(SandboxSpec(files={"n.txt": str(i)})) as sb:
                r = await sb.exec("echo hi $(cat n.txt)", timeout=60)
            ok, failed = (ok + 1, failed) if r.stdout == f"hi {i}\n" else (ok, failed + 1)
        except Exception:  # noqa: BLE001 - counted
            failed += 1

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    wall = time.perf_counter() - t
    await provider.aclose()
    return ok, failed, wall


_RATIOS = [
    ("cycle, host's view: after / before", "cycle host after", "cycle host before"),
    (
        "cycle, image rootfs after / host's view before (target <= 1.5x)",
        "cycle image after",
        "cycle host before",
    ),
    ("cycle, new zygote (warm=0): after / before", "cycle fresh after", "cycle fresh before"),
    ("exec: after / before", "exec after", "exec before"),
    ("exec with a server running: after / exec before", "exec busy after", "exec before"),
]


async def main(rev: str, iterations: int, gap_ms: float, n: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        old = load_baseline(rev, Path(tmp))
        rootfs = str(build_rootfs(Path(tmp)))
        runs = [await latency(old, rootfs, iterations, gap_ms / 1000) for _ in range(repeat)]
        print(
            f"local sandbox, before = {rev}, after = this tree; median of {iterations} interleaved rounds, "
        )
        print(f"{gap_ms:g} ms gap; {repeat} run(s): median of the runs' medians (range)")
        for key in runs[0]:
            values = [r[key] for r in runs]
            print(f"  {key:<22}{statistics.median(values):>9.2f} ms  ({min(values):.2f}-{max(values):.2f})")
        for label, top, bottom in _RATIOS:
            ratios = [r[top] / r[bottom] for r in runs]
            print(f"  {label:<66}{statistics.median(ratios):>6.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        for name, provider in (
            ("before", old.LocalSandboxProvider(old.LocalSandboxConfig())),
            ("after", LocalSandboxProvider(LocalSandboxConfig())),
        ):
            good, bad, wall = await concurrent(provider, n)
            print(f"{n} concurrent sandboxes {name}: ok={good} failed={bad} wall={wall:.2f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="a0c6b9f", help="git revision of the previous local provider")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle time before each measured call")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1, help="whole latency runs (noisy machine)")
    args = parser.parse_args()
    anyio.run(main, args.baseline, args.iterations, args.gap_ms, args.concurrency, args.repeat)
