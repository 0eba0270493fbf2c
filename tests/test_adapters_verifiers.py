"""Verifiers: a real verifiers.v1 taskset (adapters/examples/vf_say_word.py, ours) in its own venv."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import miles_env.adapters as adapters_pkg
from miles_env.adapters.worker_pool import close_workers
from miles_env.harnesses import get_harness
from miles_env.registry import load_environment
from miles_env.types import Status

SAY = Path(adapters_pkg.__file__).parent / "examples" / "vf_say_word.py"


@pytest.mark.slow
def test_verifiers_episode_reward_and_tokens() -> None:
    from miles_env.adapters.counts import cached_counts
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("verifiers")
    env = load_environment(f"verifiers:{SAY}")
    by_id = {t.id: t for t in env.tasks("test")}
    assert sorted(by_id) == ["say-apple", "say-cloud", "say-river", "say-stone"]
    assert cached_counts(env.name) == {"test": 4}  # what `env list` shows from now on

    async def main() -> tuple[list, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(tok, ["river it is", "I will not"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework"))
            eps = [await run_episode(ctx, by_id["say-river"]), await run_episode(ctx, by_id["say-apple"])]
        await close_workers()
        return eps, engine

    (ep_hit, ep_miss), engine = anyio.run(main)
    assert ep_hit.status is Status.COMPLETED, ep_hit.error
    assert ep_hit.score == 1.0 and ep_hit.reward is not None
    assert ep_hit.reward.details["rewards"]["said_it"] == 1.0  # the taskset's own reward function
    assert ep_miss.status is Status.COMPLETED and ep_miss.score == 0.0
    sampled = [
        t
        for ep in (ep_hit, ep_miss)
        for s in ep.samples
        for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        if m
    ]
    assert sampled and sampled == [t for g in engine.generations for t in g.output_ids]


@pytest.mark.slow
@pytest.mark.parametrize(("task_id", "reply"), [("say-river", "river it is"), ("say-apple", "I will not")])
def test_parity_with_verifiers_replay(task_id: str, reply: str) -> None:
    """Our reward equals verifiers' own offline re-scoring (vf-replay's path) of the episode's trace."""
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack
    from tests.adapter_parity import framework_score

    install("verifiers")
    env = load_environment(f"verifiers:{SAY}")
    task = {t.id: t for t in env.tasks("test")}[task_id]

    async def main():  # type: ignore[no-untyped-def]
        engine = ScriptedEngine(load_tokenizer("smollm2"), [reply])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework", keep_trace=True))
            ep = await run_episode(ctx, task)
        await close_workers()
        return ep

    ep = anyio.run(main)
    assert ep.status is Status.COMPLETED and ep.reward is not None, ep.error
    trace = ep.reward.details["trace"]
    payload = {"trace": trace, "taskset": SAY.stem, "path": str(SAY.parent)}
    theirs = framework_score("verifiers", "verifiers_replay.py", payload)
    assert ep.score == theirs["reward"] == (1.0 if "river" in reply else 0.0)
    assert ep.reward.details["rewards"] == theirs["rewards"]
