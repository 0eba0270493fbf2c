"""Adapter overhead: a worker call against the same framework call made in process (same venv).

OpenEnv: reset+step of adapters/examples/openenv_guess.py, (a) in process inside
the openenv venv (GuessEnv.reset/step), (b) through our worker (host -> stdio ->
worker -> GenericEnvClient WebSocket -> env server). Also: worker start time (to
the ready line, and to the first answered call) and a bare protocol round trip.
Harbor native has no worker: its verifier is test.sh in our sandbox (reported as is).

Run: python bench/bench_adapters.py [--n 200]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import miles_env.adapters as pkg
from miles_env.adapters.base import WorkerClient, python_argv
from miles_env.adapters.venv import install, venv_python

GUESS = Path(pkg.__file__).parent / "examples" / "openenv_guess.py"
INPROC = f"""
import sys, time
sys.path.insert(0, {str(GUESS.parent)!r})
from openenv_guess import GuessEnv, GuessAction
env = GuessEnv(); n = int(sys.argv[1]); t = []
for i in range(n):
    t0 = time.perf_counter(); env.reset(seed=1); env.step(GuessAction(message="river")); t.append(time.perf_counter() - t0)
t.sort(); print(t[len(t)//2])
"""


async def worker_bench(n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    w = WorkerClient(
        python_argv(venv_python("openenv"), "openenv_worker.py", f"{GUESS}:app"),
        name="openenv",
        env={"ENABLE_WEB_INTERFACE": "false"},
    )
    await w.call("info")
    first = time.perf_counter() - t0
    ready = w.start_s
    times = []
    for i in range(n):
        t1 = time.perf_counter()
        await w.call("reset", {"session": str(i), "kwargs": {"seed": 1}})
        await w.call("step", {"session": str(i), "action": {"message": "river"}})
        times.append(time.perf_counter() - t1)
        await w.call("close", {"session": str(i)})
    await w.aclose()
    faulty = WorkerClient(
        [
            sys.executable,
            "-u",
            "-c",
            "import sys; sys.path.insert(0, %r); import _rpc\n"
            "async def echo(p): return p\n_rpc.serve({'echo': echo})"
            % str(Path(pkg.__file__).parent / "workers"),
        ]
    )
    rt = []
    for _ in range(n):
        t1 = time.perf_counter()
        await faulty.call("echo", 1)
        rt.append(time.perf_counter() - t1)
    await faulty.aclose()
    return {
        "ready_s": ready,
        "first_call_s": first,
        "episode_s": statistics.median(times),
        "rt_s": statistics.median(rt),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    install("openenv")
    inproc = float(
        subprocess.run(
            [str(venv_python("openenv")), "-c", INPROC, str(n)], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    r = anyio.run(worker_bench, n)
    print("| adapter | in-process reset+step | via worker | ratio | worker ready | first call |")
    print("|---|---|---|---|---|---|")
    print(
        f"| openenv | {inproc * 1e3:.3f} ms | {r['episode_s'] * 1e3:.2f} ms | {r['episode_s'] / inproc:.0f}x | "
        f"{r['ready_s']:.2f} s | {r['first_call_s']:.2f} s |"
    )
    print(
        f"\nbare protocol round trip (stdio JSON line, host python worker): {r['rt_s'] * 1e6:.0f} us median"
    )


if __name__ == "__main__":
    main()
