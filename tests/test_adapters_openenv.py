"""OpenEnv: a real openenv-core env server (adapters/examples/openenv_guess.py, ours) in its own venv."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import miles_env.adapters as adapters_pkg
from miles_env.adapters.framework_harness import close_workers
from miles_env.harnesses import get_harness
from miles_env.registry import load_environment
from miles_env.types import Status

GUESS = Path(adapters_pkg.__file__).parent / "examples" / "openenv_guess.py"


@pytest.mark.slow
def test_openenv_episode_reward_and_tokens() -> None:
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("openenv")
    env = load_environment(f"openenv:{GUESS}:app")
    by_id = {t.id: t for t in env.tasks()}
    hit, miss = by_id["seed-1"], by_id["seed-0"]  # seed 1 -> "river", seed 0 -> "apple"

    async def main() -> tuple[list, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(tok, ["I say river", "nope", "no", "still no"])
        harness = get_harness("framework")
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, harness)
            eps = [await run_episode(ctx, hit), await run_episode(ctx, miss)]
        await close_workers()
        return eps, engine

    (ep_hit, ep_miss), engine = anyio.run(main)
    assert ep_hit.status is Status.COMPLETED, ep_hit.error
    assert ep_hit.score == 1.0 and ep_hit.reward is not None
    assert ep_hit.reward.details["steps"] == 1
    assert ep_miss.score == 0.0 and ep_miss.reward is not None and ep_miss.reward.details["steps"] == 3
    # What the model sampled is exactly what the engine produced, in order, across both episodes.
    sampled = [
        t
        for ep in (ep_hit, ep_miss)
        for s in ep.samples
        for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        if m
    ]
    assert sampled == [t for g in engine.generations for t in g.output_ids]


GARBAGE_WORKER = """
import sys
sys.path.insert(0, {workers!r})
import _rpc

async def anything(p):
    _rpc._out.write("<html>500 Internal Server Error</html>\\n")
    _rpc._out.flush()
    return None

_rpc.serve({{"info": anything, "reset": anything, "step": anything, "close": anything}})
"""


@pytest.mark.slow
def test_broken_worker_fails_its_episode_and_the_run_goes_on(tmp_path: Path) -> None:
    """run_many over [broken worker, real worker]: the first episode fails with the error, the second passes."""
    import sys

    from miles_env.adapters.framework_harness import _POOL
    from miles_env.adapters.venv import install
    from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_many
    from miles_env.stack import StackConfig, open_stack

    install("openenv")
    env = load_environment(f"openenv:{GUESS}:app")
    good = {t.id: t for t in env.tasks()}["seed-1"]
    bad = good.model_copy(update={"id": "broken", "metadata": {**good.metadata, "target": "BROKEN"}})
    script = tmp_path / "garbage_worker.py"
    script.write_text(GARBAGE_WORKER.format(workers=str(WORKERS_DIR)))
    _POOL[("openenv", "openenv_worker.py", "BROKEN")] = WorkerClient([sys.executable, "-u", str(script)])

    async def main() -> list:
        engine = ScriptedEngine(load_tokenizer("smollm2"), ["river"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            # isolation=none: the pooled host worker is the one replaced by the garbage script
            ctx = stack.rollout_context(env, get_harness("framework", isolation="none"))
            eps = await run_many(ctx, [bad, good], concurrency=2)
        await close_workers()
        return eps

    try:
        eps = {e.task_id: e for e in anyio.run(main)}
    finally:
        _POOL.pop(("openenv", "openenv_worker.py", "BROKEN"), None)
    assert eps["broken"].status is Status.FAILED
    assert "protocol error: not JSON" in (eps["broken"].error or "")
    assert eps["broken"].score == 0.0
    assert eps["seed-1"].status is Status.COMPLETED, eps["seed-1"].error
    assert eps["seed-1"].score == 1.0
