"""Rollouts: one task -> one Episode, through a sandbox, a harness and a TITO session.

Invariant: whatever happens (harness crash, hung CLI, dead engine, sandbox
failure), `run_episode` returns an Episode with a status and keeps the partial
token trajectory; it never raises for a per-episode fault, and the sandbox and
the session are always closed. Cancellation (Ctrl-C) still propagates.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import anyio

from miles_env.cost import CostConfig, episode_usage
from miles_env.environment import Environment, act_in_steps
from miles_env.errors import MilesEnvError
from miles_env.guards import Guard, GuardReport, GuardsConfig
from miles_env.harness import Harness, HarnessResult, SessionRecorder, SessionState, VerifiesInRun
from miles_env.limits import (
    DEFAULT_VERIFIER_TIMEOUT_S,
    LimitsOverride,
    agent_timeout_s,
    effective_spec,
    verifier_timeout_s,
)
from miles_env.provenance import env_distribution
from miles_env.sandbox import SandboxProvider
from miles_env.types import Episode, Resources, Reward, SandboxSpec, Status, Task

__all__ = ["RolloutContext", "run_episode", "run_group", "run_many"]


@dataclass(frozen=True, slots=True)
class RolloutContext:
    env: Environment
    harness: Harness
    provider: SandboxProvider
    proxy: SessionRecorder  # miles_env.tito.TitoProxy
    proxy_url: str  # where the proxy's HTTP app listens (host side)
    episode_timeout_s: float = 600.0
    limits: LimitsOverride | None = None  # rollout.limits: can only tighten a task's own (limits.py)
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S  # for tasks that declare none
    guards: GuardsConfig = field(default_factory=GuardsConfig)  # reward-hacking detectors (guards/)
    cost: CostConfig = field(default_factory=CostConfig)  # prices each episode's Usage (cost.py)


async def run_episode(ctx: RolloutContext, task: Task, *, group_id: str | None = None) -> Episode:
    episode_id = uuid.uuid4().hex[:16]
    handle = ctx.proxy.create_session(
        metadata={"task_id": task.id, "env": task.env, "episode_id": episode_id}
    )
    endpoint = ctx.proxy.endpoint(handle.session_id, ctx.proxy_url)
    if endpoint.max_context is None:
        endpoint = replace(endpoint, max_context=await ctx.proxy.context_limit(handle.session_id))
    timings: dict[str, float] = {}
    result: HarnessResult | None = None
    reward: Reward | None = None
    status, error = Status.FAILED, None
    report = GuardReport()
    spec: SandboxSpec | None = None
    made = False  # the sandbox exists: its seconds (create to close) are billed
    t0 = time.perf_counter()
    try:
        spec = effective_spec(ctx.env.sandbox_spec(task), ctx.limits)
        sandbox = await ctx.provider.create(spec)
        made = True
        async with sandbox:
            timings["sandbox_create_s"] = time.perf_counter() - t0
            await ctx.env.setup(task, sandbox)
            guard = await Guard.start(ctx.guards, ctx.env, task, sandbox, ctx.provider, spec)
            t1 = time.perf_counter()
            agent_s = agent_timeout_s(spec.resources, ctx.episode_timeout_s)
            if isinstance(ctx.harness, VerifiesInRun):  # its run() ends with the framework's verifier
                agent_s += verifier_timeout_s(spec.resources, ctx.verifier_timeout_s)
            with anyio.move_on_after(agent_s) as scope:
                result = _joined(await act_in_steps(
                    ctx.env, task, sandbox, lambda t: ctx.harness.run(t, sandbox, endpoint)
                ))  # fmt: skip
            timings["harness_s"] = time.perf_counter() - t1
            if scope.cancelled_caught:
                result = HarnessResult(Status.TRUNCATED, [], f"agent timeout {agent_s:g}s exceeded")
            assert result is not None
            status, error = result.status, result.error
            t2 = time.perf_counter()
            verify_s = verifier_timeout_s(spec.resources, ctx.verifier_timeout_s)
            with anyio.move_on_after(verify_s) as verify_scope:
                report = await guard.inspect(sandbox, result.metadata)  # the agent has stopped
                reward = await guard.verify(sandbox, result.transcript)
            timings["verify_s"] = time.perf_counter() - t2
            timings.update(guard.timings)
            if verify_scope.cancelled_caught:  # no reward: a verifier cut short is not a score of 0
                status, error = Status.FAILED, f"verifier timeout {verify_s:g}s exceeded"
    except anyio.get_cancelled_exc_class():
        raise
    except (MilesEnvError, OSError) as e:
        status, error = Status.FAILED, f"{type(e).__name__}: {e}"
    except Exception as e:  # a bad rollout is data, not a crash: record it, keep the run going
        status, error = Status.FAILED, f"unexpected {type(e).__name__}: {e}"
    finally:
        timings["total_s"] = time.perf_counter() - t0
    try:
        samples = ctx.proxy.export(handle.session_id)
        session = ctx.proxy.get_session(handle.session_id)
        budget_hit = session.truncated
        if budget_hit and status is Status.COMPLETED:  # the proxy cut a turn short (tokens, context)
            status, error = Status.TRUNCATED, f"session budget: {budget_hit}"
        if unfit := first_prompt_unfit(ctx.harness.name, session, endpoint.max_context):
            status, error = Status.FAILED, unfit  # the model never had a turn: nothing the policy did
    finally:
        ctx.proxy.close_session(handle.session_id)
    resources = spec.resources if spec is not None else Resources()
    usage = episode_usage(
        samples, timings["total_s"] if made else 0.0, ctx.provider.name, resources, ctx.cost
    )
    return Episode(
        id=episode_id,
        task_id=task.id,
        env=task.env,
        group_id=group_id or episode_id,
        split=task.split,
        harness=ctx.harness.name,
        status=status,
        reward=reward,
        samples=samples,
        error=error,
        timings=timings,
        flags=list(report.flags),
        usage=usage,
        metadata={
            "guards": report.evidence,
            "session_id": handle.session_id,
            "harness": result.metadata if result else {},
            "transcript": result.transcript if result else [],
            "env_dist": env_distribution(ctx.env),  # {name, version} of the env's package
            "first_prompt_tokens": session.first_prompt,  # what the harness's first request cost
        },
    )


def first_prompt_unfit(harness: str, session: SessionState, context: int | None) -> str | None:
    """The episode's error when the harness's first request was refused for its size and no turn
    followed (the CLI gave up: nothing was sampled), else None. One line, with the size."""
    if session.n_turns or session.truncated != "max_context" or session.first_prompt is None:
        return None
    return (
        f"{harness}'s first prompt is {session.first_prompt} tokens, more than the model's context "
        f"({context} tokens): nothing was sampled; trim what it sends (--harness-opt lean=true, "
        "docs/harnesses.md 'Small models') or give the engine a larger context"
    )


def _joined(results: list[HarnessResult]) -> HarnessResult:
    """One result from a task's steps (one step: itself): the first status other than completed,
    transcripts in order, each step's metadata under `steps`."""
    if len(results) == 1:
        return results[0]
    bad = next((r for r in results if r.status is not Status.COMPLETED), None)
    return HarnessResult(
        bad.status if bad else Status.COMPLETED,
        [m for r in results for m in r.transcript],
        bad.error if bad else None,
        {"steps": [r.metadata for r in results]},
    )


async def run_group(
    ctx: RolloutContext, task: Task, size: int, *, group_id: str | None = None
) -> list[Episode]:
    """`size` episodes of one task, concurrently, sharing one GRPO group id: a new one, or
    `group_id` to complete a group left open in the queue (a restart's missing episodes)."""
    group_id = group_id or f"{task.id}:{uuid.uuid4().hex[:8]}"
    out: list[Episode | None] = [None] * size

    async def one(i: int) -> None:
        out[i] = await run_episode(ctx, task, group_id=group_id)

    async with anyio.create_task_group() as tg:
        for i in range(size):
            tg.start_soon(one, i)
    return [e for e in out if e is not None]


async def run_many(
    ctx: RolloutContext,
    tasks: Sequence[Task],
    *,
    rollouts_per_task: int = 1,
    concurrency: int = 8,
    on_episode: Callable[[Episode], Awaitable[None] | None] | None = None,
) -> list[Episode]:
    """Every task `rollouts_per_task` times, at most `concurrency` episodes at once, in task order."""
    limiter = anyio.CapacityLimiter(concurrency)
    results: list[list[Episode]] = [[] for _ in tasks]

    async def one(i: int, task: Task, group_id: str) -> None:
        async with limiter:
            ep = await run_episode(ctx, task, group_id=group_id)
        results[i].append(ep)
        if on_episode is not None:
            maybe = on_episode(ep)
            if maybe is not None:
                await maybe

    async with anyio.create_task_group() as tg:
        for i, task in enumerate(tasks):
            group_id = f"{task.id}:{uuid.uuid4().hex[:8]}"
            for _ in range(rollouts_per_task):
                tg.start_soon(one, i, task, group_id)
    return [e for group in results for e in group]
