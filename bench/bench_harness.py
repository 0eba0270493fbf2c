"""Harness overhead per episode: the real Claude Code and Codex CLIs vs the built-in harness.

Each harness runs the same two-command task (tests/test_harness_claude_code.py's
two_step_task) with a zero-cost scripted policy (3 model calls: two shell tool
calls, one answer), so what is measured is the harness, not the model:
- start->1st req: from the CLI exec (or the harness's run() for builtin) to the
  engine's first generate call;
- outside model: harness wall time minus time inside engine.generate;
- episode: run_episode total (sandbox create, harness, verify, export).
Baseline: the built-in harness, measured in the same run, same policy shape.

Run: python bench/bench_harness.py [--episodes 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy  # noqa: E402
from miles_env.harnesses import get_harness  # noqa: E402
from miles_env.models import load_tokenizer  # noqa: E402
from miles_env.registry import load_environment  # noqa: E402
from miles_env.rollout import run_episode  # noqa: E402
from miles_env.stack import StackConfig, open_stack  # noqa: E402
from tests.test_harness_claude_code import TWO_STEP_POLICY, two_step_task  # noqa: E402

FENCED = ScriptedPolicy(
    (
        PolicyRule(
            None,
            (
                "```sh\necho alpha > first.txt\n```",
                '```sh\necho "$(cat first.txt) beta" > second.txt\n```',
                "DONE",
            ),
        ),
    )
)


class Timed:
    """Wraps an engine; records (start, end) wall times of every generate call."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.spans: list[tuple[float, float]] = []

    async def generate(self, input_ids: Any, sampling: Any, *, session_id: str | None = None) -> Any:
        t0 = time.time()
        try:
            return await self.inner.generate(input_ids, sampling, session_id=session_id)
        finally:
            self.spans.append((t0, time.time()))

    async def update_weights_from_disk(self, path: Any, weight_version: int | None = None) -> int:
        return await self.inner.update_weights_from_disk(path, weight_version)

    async def info(self) -> Any:
        return await self.inner.info()

    async def close(self) -> None:
        await self.inner.close()


async def one(name: str, tok: Any, store: Path) -> dict[str, float]:
    policy = FENCED if name == "builtin" else TWO_STEP_POLICY
    engine = Timed(ScriptedEngine(tok, policy=policy, max_context=1 << 20))
    env = load_environment("terminal-basics")
    async with open_stack(StackConfig(engine={"kind": "scripted"}, store_dir=store), engine=engine) as st:
        t_run = time.time()
        ep = await run_episode(st.rollout_context(env, get_harness(name)), two_step_task())
    assert ep.reward is not None and ep.reward.passed, (name, ep.status, ep.error)
    meta = ep.metadata["harness"]
    start = meta.get("cli_start", t_run + ep.timings["sandbox_create_s"])
    model_s = sum(b - a for a, b in engine.spans)
    return {
        "episode_s": ep.timings["total_s"],
        "harness_s": ep.timings["harness_s"],
        "first_req_s": engine.spans[0][0] - start,
        "outside_s": ep.timings["harness_s"] - model_s,
        "model_s": model_s,
        "calls": len(engine.spans),
        "prompt_tokens": len(engine.inner.calls[0].input_ids),
    }


async def main(episodes: int) -> None:
    tok = load_tokenizer()
    rows: dict[str, dict[str, float]] = {}
    root = Path("/tmp/miles-bench-harness")
    for name in ("builtin", "claude-code", "codex"):
        await one(name, tok, root / f"{name}-warm")  # warm the page cache and the install check
        runs = [await one(name, tok, root / f"{name}-{i}") for i in range(episodes)]
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    base = rows["builtin"]
    print(f"median of {episodes} episodes, 3 model calls each (scripted policy, zero model cost)")
    print(
        "| harness | episode s | harness s | start->1st request s | outside model calls s "
        "| model calls s | outside vs builtin | 1st prompt tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['episode_s']:.3f} | {r['harness_s']:.3f} | {r['first_req_s']:.3f} | "
            f"{r['outside_s']:.3f} | {r['model_s']:.4f} | {r['outside_s'] / base['outside_s']:.1f}x | {r['prompt_tokens']:.0f} |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=5)
    anyio.run(main, p.parse_args().episodes)
