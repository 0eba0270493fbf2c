"""The gate's sandbox stages: schema, oracle, do-nothing policy and verifier determinism.

Concept: a *probe* runs one shell script as the agent would (the task's reference solution,
or `true` for the do-nothing policy) in a fresh sandbox after `env.setup`, then calls
`env.verify` three times on the same final state with the same transcript. The oracle probe
must score 1, the nop probe 0; the three scores of each probe must be equal (a verifier
that gives one transcript two rewards cannot be trained against).

Invariant: a task's fault is data: every probe yields a `Probe` (an exception in the
sandbox, setup or verifier is its `error`), never an exception out of `run_probes`.
Sandboxes are closed by `async with`, also on cancellation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio

from miles_env.environment import Environment, act_in_steps
from miles_env.errors import RegistryError, TaskError
from miles_env.limits import LimitsOverride, effective_spec
from miles_env.oracle import StagesSolution
from miles_env.registry import validate_environment
from miles_env.sandbox import SandboxProvider
from miles_env.types import ExecResult, Task
from miles_env.validate.report import StageResult

__all__ = ["NOP_SCRIPT", "Probe", "VERIFY_REPEATS", "judge", "run_probes", "schema_stage", "tail"]

NOP_SCRIPT = "true"  # the do-nothing policy: the agent stops at once
VERIFY_REPEATS = 3
_MIN_SOLUTION_TIMEOUT_S = 60.0
TAIL_LINES = 8


def tail(text: str, n: int = TAIL_LINES) -> str:
    """The last `n` non-blank lines of `text`, each cut at 200 characters."""
    lines = [ln.rstrip()[:200] for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _headline(e: Exception) -> str:
    """An error's first line (what failed, and why where known), then its own last lines: a failed
    image build's message ends with the builder's log, whose end is the failing step."""
    first, _, rest = str(e).partition("\n")
    return f"{type(e).__name__}: {first[:500]}" + (f"\n{tail(rest)}" if rest.strip() else "")


@dataclass(frozen=True, slots=True)
class Probe:
    task_id: str
    scores: tuple[float, ...] = ()  # VERIFY_REPEATS rewards of one final state
    error: str | None = None
    solution_tail: str = ""  # the last lines the script (solution or nop) printed
    verifier_tail: str = ""  # the last lines the first verify printed (Reward.details["test_output"])
    duration_s: float = 0.0

    @property
    def score(self) -> float:
        return self.scores[0] if self.scores else 0.0


def _transcript(task: Task) -> list[dict[str, str]]:
    """The one fixed transcript every verify call of a probe sees."""
    return [
        {"role": "user", "content": task.instruction},
        {"role": "assistant", "content": "(env validate: scripted agent, no model)"},
    ]


@runtime_checkable
class ReportsBadTasks(Protocol):
    """An environment that loads the good tasks of a directory and lists the folders it could not
    read (Harbor's `harbor:/dir`)."""

    def load_problems(self) -> list[str]: ...


def schema_stage(env: Environment) -> tuple[StageResult, list[Task]]:
    """Every task validated (pydantic Task, split, env name, unique ids, checks); solutions listed."""
    try:
        counts = validate_environment(env)
        tasks = [t for split in env.splits for t in env.tasks(split)]
    except (TaskError, RegistryError) as e:
        return StageResult("schema", False, "a task is malformed", (str(e),)), []
    problems = [f"{t.id}: instruction is blank" for t in tasks if not t.instruction.strip()]
    if isinstance(env, ReportsBadTasks):
        problems += [f"did not load: {p}" for p in env.load_problems()]
    missing = [t.id for t in tasks if t.solution is None]
    if missing:
        problems.append(f"no reference solution (the oracle cannot check them): {', '.join(missing)}")
    if not tasks:
        problems.append("the environment has no tasks")
    splits = ", ".join(f"{s}: {n}" for s, n in counts.items())
    return StageResult("schema", not problems, f"{len(tasks)} tasks ({splits})", tuple(problems)), tasks


async def _probe(
    env: Environment, task: Task, provider: SandboxProvider, script: str, limits: LimitsOverride | None
) -> Probe:
    timeout = max(_MIN_SOLUTION_TIMEOUT_S, task.sandbox.resources.timeout_s)
    transcript = _transcript(task)
    t0, out = time.monotonic(), ""
    try:
        async with await provider.create(effective_spec(env.sandbox_spec(task), limits)) as sb:
            await env.setup(task, sb)
            oracle = script == task.solution

            async def act(t: Task) -> ExecResult:
                if oracle and isinstance(env, StagesSolution):  # files too large for a script
                    await env.stage_solution(t, sb)
                step_script = (t.solution or "") if oracle else script
                return await sb.exec(["bash", "-c", step_script], timeout=timeout)

            runs = await act_in_steps(env, task, sb, act)
            out = "".join(r.stdout + r.stderr for r in runs)
            rewards = [await env.verify(task, sb, transcript) for _ in range(VERIFY_REPEATS)]
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as e:  # a bad task is data: record it, keep going
        return Probe(task.id, error=_headline(e), solution_tail=tail(out),
                     duration_s=time.monotonic() - t0)  # fmt: skip
    d = rewards[0].details
    verified = str(d.get("test_output") or d.get("error") or "")
    if d.get("hint"):  # the environment's reading of the failure (Harbor: a network it lacks)
        verified += f"\nhint: {d['hint']}"
    return Probe(task.id, tuple(r.score for r in rewards), solution_tail=tail(out),
                 verifier_tail=tail(verified), duration_s=time.monotonic() - t0)  # fmt: skip


async def run_probes(
    env: Environment,
    tasks: Sequence[Task],
    provider: SandboxProvider,
    concurrency: int = 4,
    limits: LimitsOverride | None = None,
) -> tuple[list[Probe], list[Probe]]:
    """(oracle probes, nop probes), in task order; at most `concurrency` sandboxes at once;
    `limits` tightens every task's sandbox as `rollout.limits` does (`network: none`)."""
    oracle: list[Probe | None] = [None] * len(tasks)
    nop: list[Probe | None] = [None] * len(tasks)
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(i: int, task: Task) -> None:
        async with limiter:
            if task.solution is None:
                oracle[i] = Probe(task.id, error="task has no reference solution")
            else:
                oracle[i] = await _probe(env, task, provider, task.solution, limits)
        async with limiter:
            nop[i] = await _probe(env, task, provider, NOP_SCRIPT, limits)

    async with anyio.create_task_group() as tg:
        for i, task in enumerate(tasks):
            tg.start_soon(one, i, task)
    return [p for p in oracle if p is not None], [p for p in nop if p is not None]


def _with_tails(p: Probe, headline: str | None) -> str:
    """`task: headline`, then the last lines of the script's and the verifier's output (if any)."""
    lines = [f"{p.task_id}: {headline}"]
    for name, text in (("solution", p.solution_tail), ("verifier", p.verifier_tail)):
        if text:
            lines.append(f"{name} output (last lines):")
            lines += [f"  | {ln}" for ln in text.splitlines()]
    return "\n".join(lines)


def judge(oracle: list[Probe], nop: list[Probe], duration_s: float) -> list[StageResult]:
    """The oracle, nop and determinism stages from the probes."""
    n = len(oracle)
    bad_oracle = [
        _with_tails(p, p.error or f"oracle scored {p.score:g}, want 1")
        for p in oracle
        if p.error or p.score < 1.0
    ]
    nop_passes = [
        _with_tails(p, f"a do-nothing agent scores {p.score:g}") for p in nop if not p.error and p.score > 0
    ]
    nop_errors = [_with_tails(p, p.error) for p in nop if p.error]
    unstable = [
        f"{p.task_id} ({kind}): same transcript, rewards {', '.join(f'{s:g}' for s in p.scores)}"
        for kind, probes in (("oracle", oracle), ("nop", nop))
        for p in probes
        if len(set(p.scores)) > 1
    ]
    checked = sum(1 for p in [*oracle, *nop] if p.scores)
    share = duration_s / 3
    return [
        StageResult("oracle", not bad_oracle, f"{n - len(bad_oracle)}/{n} reference solutions score 1",
                    tuple(bad_oracle), duration_s=share),
        StageResult("nop", not nop_passes and not nop_errors,
                    f"{n - len(nop_passes) - len(nop_errors)}/{n} tasks score 0 for a do-nothing agent",
                    tuple(nop_passes + nop_errors), duration_s=share),
        StageResult("determinism", checked > 0 and not unstable,
                    f"{checked - len(unstable)}/{checked} final states got one reward from "
                    f"{VERIFY_REPEATS} verifies", tuple(unstable) or (() if checked else ("nothing verified",)),
                    duration_s=share),
    ]  # fmt: skip
