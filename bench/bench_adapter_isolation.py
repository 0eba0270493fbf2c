"""Framework worker start: on the host (isolation=none) against inside a bubblewrap sandbox (default).

For each installed framework, the real adapter worker is started and asked its first
question (listing tasks; OpenEnv: `info`, which starts its env server) either as a plain
child process or, as `isolation="sandbox"` does per episode, inside a fresh local
sandbox: create the sandbox, bind the venv/base Python/worker scripts/env files
read-only, expose() a host URL, spawn the worker, first answer, close. Medians of
`--n` runs; the ratio is sandboxed / host in the same run.

With `--episodes`, whole verifiers episodes (ScriptedEngine) are timed per isolation mode:
the pooled host worker (warm) against a fresh sandboxed worker per episode.

Run: python bench/bench_adapter_isolation.py [--n 3] [--only verifiers ...] [--episodes]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import anyio

import miles_env.adapters as pkg
from miles_env.adapters.isolation import adapter_sandbox_spec, ro_paths
from miles_env.adapters.venv import get_spec, venv_python
from miles_env.adapters.worker_client import WorkerClient, python_argv
from miles_env.sandboxes.local import LocalSandboxProvider
from miles_env.sandboxes.local.spawn import spawn

EX = Path(pkg.__file__).parent / "examples"
REAL = {  # adapter worker, its arguments, first call
    "verifiers": ("verifiers_worker.py", ("vf_say_word", str(EX)), "tasks"),
    "hud": ("hud_worker.py", (str(EX / "hud_say_word.py"),), "tasks"),
    "nemo-gym": ("nemo_gym_worker.py", ("mcqa",), "tasks"),
    "openenv": ("openenv_worker.py", (f"{EX / 'openenv_guess.py'}:app",), "info"),
}


async def host(name: str) -> float:
    script, args, first = REAL[name]
    t0 = time.perf_counter()
    w = WorkerClient(python_argv(venv_python(name), script, *args), env=get_spec(name).env, name=name)
    await w.call(first)
    took = time.perf_counter() - t0
    await w.aclose()
    return took


async def sandboxed(name: str, provider: LocalSandboxProvider) -> float:
    script, args, first = REAL[name]
    argv = python_argv(venv_python(name), script, *args)
    env = {"PYTHONUNBUFFERED": "1", **get_spec(name).env}
    t0 = time.perf_counter()
    async with await provider.create(adapter_sandbox_spec()) as sb:
        for p in ro_paths(name, [str(EX)]):
            sb.mount_ro(p, p)
        await sb.expose("http://127.0.0.1:9/v1")  # the TITO session's bridge, as in an episode

        async def opener():  # type: ignore[no-untyped-def]
            return await spawn(sb, argv, env=env)

        w = WorkerClient(argv, name=name, opener=opener)
        await w.call(first)
        took = time.perf_counter() - t0
        await w.aclose()
    return took


async def episodes(n: int) -> None:
    """Whole verifiers episodes (ScriptedEngine, say-word) per isolation mode, medians of n."""
    from miles_env.adapters.worker_pool import close_workers
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses import get_harness
    from miles_env.models import load_tokenizer
    from miles_env.registry import load_environment
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    env = load_environment(f"verifiers:{EX / 'vf_say_word.py'}")
    task = {t.id: t for t in env.tasks("test")}["say-river"]
    out = {}
    for mode in ("none", "sandbox"):
        engine = ScriptedEngine(load_tokenizer("smollm2"), ["river it is"] * 16)
        times = []
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework", isolation=mode))
            for _ in range(n + (mode == "none")):  # none: the first episode starts the pooled worker
                t0 = time.perf_counter()
                ep = await run_episode(ctx, task)
                times.append(time.perf_counter() - t0)
                assert ep.score == 1.0, ep.error
        await close_workers()
        out[mode] = statistics.median(times[1:] if mode == "none" else times)
    print(
        "\n| verifiers episode (say-word, scripted) | isolation=none (warm pooled worker) | isolation=sandbox | ratio |"
    )
    print("|---|---|---|---|")
    print(
        f"| per episode | {out['none']:.2f} s | {out['sandbox']:.2f} s | {out['sandbox'] / out['none']:.2f}x |"
    )


async def main(n: int, only: list[str], with_episodes: bool) -> None:
    provider = LocalSandboxProvider()
    print(
        "| adapter | host worker, first answer | in sandbox (create+mounts+expose+spawn), first answer | ratio |"
    )
    print("|---|---|---|---|")
    for name in only or list(REAL):
        if not venv_python(name).exists():
            print(f"| {name} | not installed | | |")
            continue
        h = statistics.median([await host(name) for _ in range(n)])
        s = statistics.median([await sandboxed(name, provider) for _ in range(n)])
        print(f"| {name} | {h:.2f} s | {s:.2f} s | {s / h:.2f}x |")
    if with_episodes:
        await episodes(n)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="adapters to measure (default: all)")
    ap.add_argument("--episodes", action="store_true", help="also time whole verifiers episodes")
    args = ap.parse_args()
    anyio.run(main, args.n, args.only, args.episodes)
