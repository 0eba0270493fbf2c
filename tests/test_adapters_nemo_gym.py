"""NeMo Gym: the `mcqa` resources server shipped with nemo-gym, its /verify, and its simple_agent."""

from __future__ import annotations

import anyio
import pytest

from miles_env.adapters.worker_pool import close_workers
from miles_env.harnesses import get_harness
from miles_env.registry import load_environment
from miles_env.types import Status


@pytest.mark.slow
def test_nemo_gym_episode_reward_and_tokens() -> None:
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("nemo-gym")
    env = load_environment("nemo-gym:mcqa")
    task = env.tasks("test")[0]  # example row 0: expected answer B (strict \boxed{} grading)
    assert "cystic fibrosis" in task.instruction

    async def main() -> tuple[list, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(tok, ["\\boxed{B}", "\\boxed{C}"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework"))
            eps = [await run_episode(ctx, task), await run_episode(ctx, task)]
        await close_workers()
        return eps, engine

    (ep_hit, ep_miss), engine = anyio.run(main)
    assert ep_hit.status is Status.COMPLETED, ep_hit.error
    assert ep_hit.score == 1.0 and ep_hit.reward is not None
    assert ep_hit.reward.details["extracted_answer"] == "B"  # mcqa's own /verify response
    assert ep_miss.status is Status.COMPLETED and ep_miss.score == 0.0, ep_miss.error
    sampled = [
        t
        for ep in (ep_hit, ep_miss)
        for s in ep.samples
        for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        if m
    ]
    assert sampled and sampled == [t for g in engine.generations for t in g.output_ids]


@pytest.mark.slow
@pytest.mark.parametrize("reply", ["\\boxed{B}", "\\boxed{C}"])
def test_parity_with_nemo_gym_verify(reply: str) -> None:
    """Our episode's reward equals NeMo Gym's own /verify on the same reply (called directly)."""
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack
    from tests.adapter_parity import framework_score, reply_text

    install("nemo-gym")
    env = load_environment("nemo-gym:mcqa")
    task = env.tasks("test")[0]
    tok = load_tokenizer("smollm2")

    async def main():  # type: ignore[no-untyped-def]
        async with open_stack(StackConfig(), engine=ScriptedEngine(tok, [reply])) as stack:
            ep = await run_episode(stack.rollout_context(env, get_harness("framework")), task)
        await close_workers()
        return ep

    ep = anyio.run(main)
    assert ep.status is Status.COMPLETED, ep.error
    said = reply_text(ep, tok)
    theirs = framework_score("nemo-gym", "nemo_gym_verify.py", {"server": "mcqa", "idx": 0, "reply": said})
    assert ep.score == theirs["reward"] == (1.0 if "B" in reply else 0.0)
    assert ep.reward is not None and ep.reward.details["extracted_answer"] == theirs["verify"]
