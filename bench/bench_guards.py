"""Per-episode overhead of the reward-hacking guards: guards off vs on (same sandbox) vs on (fresh).

Each episode is a real rollout (local bwrap sandbox, TITO proxy, builtin harness) of a built-in
terminal task with a zero-cost scripted policy that runs the task's reference solution, looks
(`ls -la`) and says DONE, so the model costs nothing and what differs between the modes is the
guards: the snapshot after setup (protected files read through the provider, git objects listed),
the inspection after the harness (files re-read, commands matched), and for `fresh` the copy of
the workspace into a new sandbox before verify. The modes run interleaved, task by task, in the
same process (the baseline, guards off, is measured in the same run). Three groups: tasks
without protected files, terminal-hard tasks with a protected test file, and a git task (the
guarded environment of tests/guards_support.py: a repository scrubbed in setup, its object list
taken by the snapshot). A zero-cost model makes the
episode as short as it gets, so the share printed is an upper bound on a real episode's.

Run: python bench/bench_guards.py [--repeat 3] [--basics 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy  # noqa: E402
from miles_env.guards import GuardsConfig  # noqa: E402
from miles_env.harnesses.builtin import BuiltinHarness  # noqa: E402
from miles_env.models import load_tokenizer  # noqa: E402
from miles_env.registry import load_environment  # noqa: E402
from miles_env.rollout import run_episode  # noqa: E402
from miles_env.sandboxes import get_provider  # noqa: E402
from miles_env.stack import StackConfig, open_stack  # noqa: E402
from miles_env.types import Episode, Task  # noqa: E402
from tests.guards_support import GuardedEnv  # noqa: E402

MODES: dict[str, GuardsConfig] = {
    "off": GuardsConfig(enabled=False),
    "on (same)": GuardsConfig(),
    "on (fresh)": GuardsConfig(verify_in="fresh"),
}
GUARD_KEYS = ("guard_snapshot_s", "guard_inspect_s", "guard_fresh_s")


def _policy(tasks: list[Task]) -> ScriptedPolicy:
    ordered = sorted(tasks, key=lambda t: -len(t.instruction))  # a longer instruction may hold a shorter
    return ScriptedPolicy(
        tuple(
            PolicyRule(t.instruction, (f"```sh\n{t.solution}\n```", "```sh\nls -la\n```", "DONE"))
            for t in ordered
        )
    )


Results = dict[tuple[str, str], list[Episode]]


async def _run(groups: dict[str, list[tuple[Any, Task]]], repeat: int) -> Results:
    tasks = [t for pairs in groups.values() for _, t in pairs]
    engine = ScriptedEngine(load_tokenizer("smollm2"), policy=_policy(tasks))
    out: Results = {(g, m): [] for g in groups for m in MODES}
    harness = BuiltinHarness(max_turns=4, max_tokens=2048)
    async with open_stack(StackConfig(), engine=engine) as stack:
        for r in range(repeat + 1):  # round 0 warms the sandbox provider and the proxy up
            for group, pairs in groups.items():
                for env, task in pairs:
                    for mode, cfg in MODES.items():
                        ctx = replace(stack.rollout_context(env, harness), guards=cfg)
                        ep = await run_episode(ctx, task)
                        if r > 0:
                            out[(group, mode)].append(ep)
    return out


async def _scrub_ms(env: Any, task: Task, n: int) -> list[float]:
    """`scrub_git` alone on the git task's repository (it runs in that environment's setup)."""
    from miles_env.guards import scrub_git

    provider, times = get_provider("local"), []
    for _ in range(n):
        async with await provider.create(task.sandbox) as sb:
            env.scrub = False
            await env.setup(task, sb)
            t0 = time.perf_counter()
            await scrub_git(sb, ".", "main")
            times.append(time.perf_counter() - t0)
    env.scrub = True
    return times


def _ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.1f}" if xs else "-"


def _table(res: Results, group: str) -> None:
    base = statistics.median(e.timings["total_s"] for e in res[(group, "off")])
    print("| mode | passed | flagged | episode ms | vs off | snapshot ms | inspect ms | fresh copy ms | verify ms "
          "| guards' share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        eps = res[(group, mode)]
        total = [e.timings["total_s"] for e in eps]
        guard = [sum(e.timings.get(k, 0.0) for k in GUARD_KEYS) for e in eps]
        share = statistics.median(g / t for g, t in zip(guard, total, strict=True))
        cols = [_ms([e.timings[k] for e in eps if k in e.timings]) for k in GUARD_KEYS]
        passed = sum(e.reward is not None and e.reward.passed for e in eps)
        flagged = sum(bool(e.flags) for e in eps)
        print(
            f"| {mode} | {passed}/{len(eps)} | {flagged} | {_ms(total)} | {statistics.median(total) / base:.2f}x | "
            f"{' | '.join(cols)} | {_ms([e.timings['verify_s'] for e in eps])} | {share:.1%} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--basics", type=int, default=12, help="terminal-basics train tasks (every 4th)")
    args = ap.parse_args()
    hard, basics, guarded = (
        load_environment("terminal-hard"),
        load_environment("terminal-basics"),
        GuardedEnv(),
    )
    with_tests = {"python-fizzbuzz", "fix-median"}  # the tasks with protected test files
    groups: dict[str, list[tuple[Any, Task]]] = {
        "terminal tasks without test files": [
            (hard, t) for t in hard.tasks("train") if t.id not in with_tests
        ]
        + [(basics, t) for t in basics.tasks("train")[::4]][: args.basics],
        "terminal-hard with a protected test file": [(hard, hard.task(i)) for i in sorted(with_tests)],
        "a git repository (scrubbed in setup) and a test file": [(guarded, guarded.task("git-fix"))],
    }
    res = anyio.run(_run, groups, args.repeat)
    for group, pairs in groups.items():
        print(f"\n{group}: {len(pairs)} tasks x {args.repeat} repeats per mode; medians per episode\n")
        _table(res, group)
    scrub = anyio.run(_scrub_ms, guarded, guarded.task("git-fix"), 5)
    print(f"\nscrub_git on the 2-commit repository (in setup, not in the table): {_ms(scrub)} ms median of 5")


if __name__ == "__main__":
    main()
