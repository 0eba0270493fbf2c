"""Harbor: the cost of the Dockerfile setup phase and of Harbor's own LLM agent per episode.

Usage: python bench/bench_harbor.py [--n 3]

1. Setup phase (local sandbox): sandbox create + `env.setup` (the Dockerfile of
   adapters/examples/harbor_tasks/setup_steps replayed: ARG/ENV/WORKDIR/2 COPY/3 RUN)
   against sandbox create alone, same task.
2. One scripted episode of the `hello` task (ScriptedEngine -> TITO -> harness ->
   sandbox -> verifier): `--harness framework` with Harbor's terminus-2 (Harbor Trial in
   the worker, tmux terminal, Harbor's verifier; two model turns) against our builtin
   harness (two model turns, native verifier). The first framework episode includes the
   harbor worker's start, reported apart.

Needs the harbor venv (`miles-env adapters install harbor`) and tmux.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "adapters" / "examples" / "harbor_tasks"


def terminus_reply(keystrokes: list[str], done: bool) -> str:
    commands = [{"keystrokes": k, "duration": 0.3} for k in keystrokes]
    return json.dumps({"analysis": "a", "plan": "p", "commands": commands, "task_complete": done})


async def setup_phase(n: int) -> dict[str, float]:
    from miles_env.adapters.harbor import HarborTasksEnvironment
    from miles_env.sandboxes import get_provider

    env = HarborTasksEnvironment(TASKS / "setup_steps")
    (task,) = env.tasks("test")
    provider = get_provider("local")
    bare, setup = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        async with await provider.create(env.sandbox_spec(task)):
            bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        async with await provider.create(env.sandbox_spec(task)) as sb:
            await env.setup(task, sb)
            setup.append(time.perf_counter() - t0)
    return {"bare": statistics.median(bare), "setup": statistics.median(setup)}


async def episodes(n: int) -> dict[str, Any]:
    from miles_env.adapters.framework_harness import FrameworkHarness
    from miles_env.adapters.worker_pool import close_workers
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses.builtin import BuiltinHarness
    from miles_env.models import load_tokenizer
    from miles_env.registry import load_environment
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    env = load_environment(f"harbor:{TASKS / 'hello'}")
    (task,) = env.tasks("test")
    tok = load_tokenizer("smollm2")
    solve = "mkdir -p /app/out && echo 'hello harbor' > /app/out/hello.txt\n"
    out: dict[str, Any] = {"framework": [], "builtin": []}

    async def one(harness: Any, replies: list[str]) -> float:
        engine = ScriptedEngine(tok, replies)
        async with open_stack(StackConfig(), engine=engine) as stack:
            t0 = time.perf_counter()
            ep = await run_episode(stack.rollout_context(env, harness), task)
            dt = time.perf_counter() - t0
        assert ep.score == 1.0, (ep.status, ep.error, ep.reward)
        return dt

    t2 = [terminus_reply([solve], True), terminus_reply([], True)]
    builtin = [f"```sh\n{solve}```", "DONE"]
    try:
        out["first_framework"] = await one(FrameworkHarness(agent="terminus-2"), t2)
        for _ in range(n):
            out["framework"].append(await one(FrameworkHarness(agent="terminus-2"), t2))
            out["builtin"].append(await one(BuiltinHarness(), builtin))
    finally:
        await close_workers()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3)
    n = ap.parse_args().n
    sys.path.insert(0, str(ROOT / "tests"))
    s = anyio.run(setup_phase, n)
    e = anyio.run(episodes, n)
    fw, bi = statistics.median(e["framework"]), statistics.median(e["builtin"])
    print(f"| measure (median of {n}) | baseline | harbor | ratio |")
    print("|---|---|---|---|")
    print(
        f"| sandbox create + Dockerfile setup phase (setup_steps) | create alone {s['bare'] * 1e3:.0f} ms "
        f"| {s['setup'] * 1e3:.0f} ms | {s['setup'] / s['bare']:.1f}x |"
    )
    print(
        f"| scripted 2-turn episode of `hello` | builtin harness {bi:.2f} s "
        f"| terminus-2 (Harbor Trial) {fw:.2f} s | {fw / bi:.1f}x |"
    )
    print(f"\nfirst terminus-2 episode, harbor worker start included: {e['first_framework']:.2f} s")


if __name__ == "__main__":
    main()
