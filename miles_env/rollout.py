"""Rollouts: one task -> one Episode, through a sandbox, a harness and a TITO session.

Invariant: whatever happens (harness crash, hung CLI, dead engine, sandbox
failure), `run_episode` returns an Episode with a status and keeps the partial
token trajectory; it never raises for a per-episode fault, and the sandbox and
the session are always closed. Cancellation (Ctrl-C) still propagates.
Every Episode carries its end class (`Episode.end`), decided where the ending was
raised (miles_env/ends.py): the phase that raised, a typed error's own class, the
harness's result, the proxy's record of the session's last request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import anyio

from miles_env.cost import CostConfig, episode_usage
from miles_env.ends import Phase, end_of_error, end_of_harness
from miles_env.environment import Environment, act_in_steps
from miles_env.errors import MilesEnvError
from miles_env.guards import Guard, GuardReport, GuardsConfig
from miles_env.harness import (
    Endpoint,
    Harness,
    HarnessResult,
    SessionRecorder,
    SessionState,
    VerifiesInRun,
)
from miles_env.limits import (
    DEFAULT_VERIFIER_TIMEOUT_S,
    LimitsOverride,
    agent_timeout_s,
    effective_spec,
    verifier_timeout_s,
)
from miles_env.provenance import env_distribution
from miles_env.sandbox import SandboxProvider
from miles_env.types import Episode, EpisodeEnd, Resources, Reward, SandboxSpec, Status, Task, Trajectory

__all__ = ["GroupRun", "RolloutContext", "run_episode", "run_group", "run_many", "run_valid_group"]


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


@dataclass(slots=True)
class _Run:
    """What one episode gathers as it goes (run_episode's phases fill it in)."""

    timings: dict[str, float] = field(default_factory=dict)
    result: HarnessResult | None = None
    reward: Reward | None = None
    status: Status = Status.FAILED
    end: EpisodeEnd = EpisodeEnd.UNCLASSIFIED
    error: str | None = None
    report: GuardReport = field(default_factory=GuardReport)
    spec: SandboxSpec | None = None
    made: bool = False  # the sandbox exists: its seconds (create to close) are billed
    phase: Phase | None = None  # the phase running now: an exception's class defaults to its
    failed: bool = False  # the end is decided (fail): the harness's result no longer says it
    first_prompt: int | None = None  # tokens of the harness's first request (the proxy's count)

    def fail(self, end: EpisodeEnd, error: str) -> None:
        self.status, self.end, self.error, self.failed = Status.FAILED, end, error, True


async def _phases(ctx: RolloutContext, task: Task, endpoint: Endpoint, run: _Run) -> None:
    """sandbox (create, setup, guards) -> harness -> verify; raises what a phase raised."""
    t0 = time.perf_counter()
    run.phase = "sandbox"
    run.spec = spec = effective_spec(ctx.env.sandbox_spec(task), ctx.limits)
    sandbox = await ctx.provider.create(spec)
    run.made = True
    async with sandbox:
        run.timings["sandbox_create_s"] = time.perf_counter() - t0
        await ctx.env.setup(task, sandbox)
        guard = await Guard.start(ctx.guards, ctx.env, task, sandbox, ctx.provider, spec)
        run.phase = "harness"
        t1 = time.perf_counter()
        agent_s = agent_timeout_s(spec.resources, ctx.episode_timeout_s)
        if isinstance(ctx.harness, VerifiesInRun):  # its run() ends with the framework's verifier
            agent_s += verifier_timeout_s(spec.resources, ctx.verifier_timeout_s)
        with anyio.move_on_after(agent_s) as scope:
            run.result = _joined(await act_in_steps(
                ctx.env, task, sandbox, lambda t: ctx.harness.run(t, sandbox, endpoint)
            ))  # fmt: skip
        run.timings["harness_s"] = time.perf_counter() - t1
        if scope.cancelled_caught:  # the agent's own time ran out: a policy end
            run.result = HarnessResult(Status.TRUNCATED, [], f"agent timeout {agent_s:g}s exceeded")
        assert run.result is not None
        run.status, run.error = run.result.status, run.result.error
        run.phase = "verify"
        t2 = time.perf_counter()
        verify_s = verifier_timeout_s(spec.resources, ctx.verifier_timeout_s)
        with anyio.move_on_after(verify_s) as verify_scope:
            run.report = await guard.inspect(sandbox, run.result.metadata)  # the agent has stopped
            run.reward = await guard.verify(sandbox, run.result.transcript)
        run.timings["verify_s"] = time.perf_counter() - t2
        run.timings.update(guard.timings)
        if verify_scope.cancelled_caught:  # no reward: a verifier cut short is not a score of 0
            run.fail(EpisodeEnd.VERIFIER_TIMEOUT, f"verifier timeout {verify_s:g}s exceeded")
        run.phase = None


async def run_episode(ctx: RolloutContext, task: Task, *, group_id: str | None = None) -> Episode:
    episode_id = uuid.uuid4().hex[:16]
    handle = ctx.proxy.create_session(
        metadata={"task_id": task.id, "env": task.env, "episode_id": episode_id}
    )
    endpoint = ctx.proxy.endpoint(handle.session_id, ctx.proxy_url)
    if endpoint.max_context is None:
        endpoint = replace(endpoint, max_context=await ctx.proxy.context_limit(handle.session_id))
    run = _Run()
    t0 = time.perf_counter()
    try:
        await _phases(ctx, task, endpoint, run)
    except anyio.get_cancelled_exc_class():
        raise
    except (MilesEnvError, OSError) as e:
        run.fail(end_of_error(e, run.phase), f"{type(e).__name__}: {e}")
    except Exception as e:  # a bad rollout is data, not a crash: record it, keep the run going
        run.fail(end_of_error(e, run.phase), f"unexpected {type(e).__name__}: {e}")
    finally:
        run.timings["total_s"] = time.perf_counter() - t0
    try:
        samples = ctx.proxy.export(handle.session_id)
        session = ctx.proxy.get_session(handle.session_id)
        said = run.result.end if run.result is not None else None
        if session.truncated and run.status is Status.COMPLETED:  # the proxy cut a turn short
            run.status, run.error, said = Status.TRUNCATED, f"session budget: {session.truncated}", None
        if run.result is not None and not run.failed:  # the harness returned: its end, or the proxy's
            run.end = end_of_harness(run.status, said, session.fault)
        run.first_prompt = session.first_prompt
        if unfit := first_prompt_unfit(ctx.harness.name, session, endpoint.max_context):
            # every request the harness made was refused: the model never had a turn, so nothing
            # the policy did (never trained)
            run.fail(EpisodeEnd.PROXY_REFUSAL, unfit)
    finally:
        ctx.proxy.close_session(handle.session_id)
    return _episode(ctx, task, run, samples, episode_id, group_id, handle.session_id)


def _episode(
    ctx: RolloutContext,
    task: Task,
    run: _Run,
    samples: list[Trajectory],
    episode_id: str,
    group_id: str | None,
    session_id: str,
) -> Episode:
    resources = run.spec.resources if run.spec is not None else Resources()
    total = run.timings["total_s"] if run.made else 0.0
    usage = episode_usage(samples, total, ctx.provider.name, resources, ctx.cost)
    return Episode(
        id=episode_id,
        task_id=task.id,
        env=task.env,
        group_id=group_id or episode_id,
        split=task.split,
        harness=ctx.harness.name,
        status=run.status,
        end=run.end,
        reward=run.reward,
        samples=samples,
        error=run.error,
        timings=run.timings,
        flags=list(run.report.flags),
        usage=usage,
        metadata={
            "guards": run.report.evidence,
            "session_id": session_id,
            "harness": run.result.metadata if run.result else {},
            "transcript": run.result.transcript if run.result else [],
            "env_dist": env_distribution(ctx.env),  # {name, version} of the env's package
            "first_prompt_tokens": run.first_prompt,  # what the harness's first request cost
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
    transcripts in order, each step's metadata under `steps`; the end: that first one's."""
    if len(results) == 1:
        return results[0]
    bad = next((r for r in results if r.status is not Status.COMPLETED), None)
    return HarnessResult(
        bad.status if bad else Status.COMPLETED,
        [m for r in results for m in r.transcript],
        bad.error if bad else None,
        {"steps": [r.metadata for r in results]},
        bad.end if bad else results[-1].end,
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


@dataclass(frozen=True, slots=True)
class GroupRun:
    """A group rolled out until enough of it ended by the policy (`run_valid_group`)."""

    episodes: list[Episode]  # the group to queue (its size members), or [] when dropped
    replaced: list[Episode]  # infrastructure failures rolled out again, and a dropped group's all
    rerolled: int  # episodes rolled out again
    dropped: bool  # still fewer than min_valid policy ends once the attempts ran out

    @property
    def rolled_out(self) -> list[Episode]:
        return [*self.episodes, *self.replaced]


async def run_valid_group(
    ctx: RolloutContext,
    task: Task,
    size: int,
    *,
    policy_ends: Collection[EpisodeEnd],
    min_valid: int | None = None,
    attempts: int = 2,
    group_id: str | None = None,
) -> GroupRun:
    """`run_group`, then while fewer than `min_valid` (None: `size`) members ended by the policy,
    the failed ones (infrastructure: they never train) are rolled out again under the same group
    id, at most `attempts` rounds; a group still short is dropped (its episodes all `replaced`)."""
    group_id = group_id or f"{task.id}:{uuid.uuid4().hex[:8]}"
    need = size if min_valid is None else min(min_valid, size)
    episodes = await run_group(ctx, task, size, group_id=group_id)
    replaced: list[Episode] = []
    rerolled = 0
    for round_ in range(attempts + 1):
        kept = [ep for ep in episodes if ep.end in policy_ends]
        if len(kept) >= need:
            return GroupRun(episodes, replaced, rerolled, False)
        if round_ == attempts:
            break
        failed = [ep for ep in episodes if ep.end not in policy_ends]
        replaced += failed
        rerolled += len(failed)
        episodes = kept + await run_group(ctx, task, len(failed), group_id=group_id)
    return GroupRun([], [*replaced, *episodes], rerolled, True)


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
