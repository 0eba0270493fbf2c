"""The oracle runner: reference solutions through real sandboxes and real verifiers.

Concept: for each task, create a sandbox from `env.sandbox_spec(task)`, run
`env.setup`, run `task.solution` (a shell script, `bash -c`) in the workdir, then
grade with `env.verify`. An environment whose oracle does not pass 100% has a bug
in a task, its solution or its verifier.

Invariant: a failing task is data, never a crash: every task yields exactly one
OracleResult (sandbox or verifier exceptions are recorded as `error`, and classed as an
episode's would be: `end`, by the phase that raised, miles_env/ends.py). Sandboxes
are closed by `async with`, also on cancellation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio

from miles_env.ends import Phase, end_of_error
from miles_env.environment import Environment, act_in_steps
from miles_env.guards import Guard, GuardsConfig
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import EpisodeEnd, ExecResult, Task

__all__ = ["OracleResult", "OracleReport", "StagesSolution", "run_oracle", "run_solution"]

_SOLUTION_TIMEOUT_S = 60.0


@runtime_checkable
class StagesSolution(Protocol):
    """An environment whose reference solution needs files a shell script cannot carry (binary,
    large): uploaded after setup, before the task's own solution runs (Harbor's solution/)."""

    async def stage_solution(self, task: Task, sandbox: Sandbox) -> None: ...


@dataclass(frozen=True, slots=True)
class OracleResult:
    task_id: str
    split: str
    passed: bool
    score: float
    details: dict[str, Any] = field(default_factory=dict)
    solution_exit_code: int | None = None
    solution_stderr: str = ""
    error: str | None = None  # infrastructure error (sandbox, verifier), if any
    duration_s: float = 0.0
    tier: Any = None
    flags: tuple[str, ...] = ()  # reward-hacking flags the guards raised (miles_env/guards)
    end: EpisodeEnd = EpisodeEnd.COMPLETED  # the solution ran and was graded; else the failure's class

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "end": self.end.value,
            "flags": list(self.flags),
            "split": self.split,
            "tier": self.tier,
            "passed": self.passed,
            "score": self.score,
            "solution_exit_code": self.solution_exit_code,
            "solution_stderr": self.solution_stderr,
            "error": self.error,
            "duration_s": round(self.duration_s, 3),
            "details": self.details,
        }


@dataclass(frozen=True, slots=True)
class OracleReport:
    env: str
    results: tuple[OracleResult, ...]
    duration_s: float = 0.0

    @property
    def n_total(self) -> int:
        return len(self.results)

    @property
    def n_passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def pass_rate(self) -> float:
        return self.n_passed / self.n_total if self.results else 0.0

    @property
    def failures(self) -> list[OracleResult]:
        return [r for r in self.results if not r.passed]

    def ends(self) -> dict[str, int]:
        """How many tasks ended in each class (completed: the solution ran and was graded)."""
        out: dict[str, int] = {}
        for r in self.results:
            out[r.end.value] = out.get(r.end.value, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "n_total": self.n_total,
            "n_passed": self.n_passed,
            "pass_rate": self.pass_rate,
            "ends": self.ends(),
            "duration_s": round(self.duration_s, 3),
            "failures": [r.to_dict() for r in self.failures],
            "results": [r.to_dict() for r in self.results],
        }


async def run_solution(
    env: Environment,
    task: Task,
    provider: SandboxProvider,
    solution: str | None = None,
    guards: GuardsConfig | None = None,
) -> OracleResult:
    """Run one script (default: the task's reference solution) and grade it, guarded as an
    episode is (the script is the one recorded command; default `GuardsConfig()`)."""
    script = task.solution if solution is None else solution
    t0 = time.monotonic()
    tier = task.metadata.get("tier")
    if script is None:
        return OracleResult(
            task.id, task.split, False, 0.0, error="task has no reference solution", tier=tier
        )
    phase: Phase = "sandbox"
    try:
        async with await provider.create(env.sandbox_spec(task)) as sb:
            await env.setup(task, sb)
            guard = await Guard.start(guards or GuardsConfig(), env, task, sb, provider)
            phase = "harness"  # the solution stands in for the agent

            async def act(t: Task) -> ExecResult:
                if solution is None and isinstance(env, StagesSolution):
                    await env.stage_solution(t, sb)
                return await sb.exec(
                    ["bash", "-c", script if solution else t.solution or ""], timeout=_SOLUTION_TIMEOUT_S
                )

            runs = await act_in_steps(env, task, sb, act)
            res = runs[-1]
            phase = "verify"
            execs = [{"command": script, "exit_code": r.exit_code} for r in runs]
            report = await guard.inspect(sb, {"execs": execs})
            reward = await guard.verify(sb, [])
    except Exception as e:  # a bad rollout is data: record it, keep going
        return OracleResult(
            task.id, task.split, False, 0.0, error=f"{type(e).__name__}: {e}",
            duration_s=time.monotonic() - t0, tier=tier, end=end_of_error(e, phase),
        )  # fmt: skip
    return OracleResult(
        task_id=task.id,
        split=task.split,
        passed=reward.passed,
        score=reward.score,
        details=dict(reward.details),
        solution_exit_code=res.exit_code,
        solution_stderr=res.stderr[-2000:],
        duration_s=time.monotonic() - t0,
        tier=tier,
        flags=report.flags,
    )


async def run_oracle(
    env: Environment,
    tasks: Sequence[Task],
    provider: SandboxProvider,
    concurrency: int = 4,
    solution: str | None = None,
) -> OracleReport:
    """Run every task's reference solution (or `solution` for all) with bounded concurrency.

    Results keep the order of `tasks`.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    results: list[OracleResult | None] = [None] * len(tasks)
    limiter = anyio.CapacityLimiter(concurrency)
    t0 = time.monotonic()

    async def one(i: int, task: Task) -> None:
        async with limiter:
            results[i] = await run_solution(env, task, provider, solution)

    async with anyio.create_task_group() as tg:
        for i, task in enumerate(tasks):
            tg.start_soon(one, i, task)
    done = tuple(r for r in results if r is not None)
    return OracleReport(env=env.name, results=done, duration_s=time.monotonic() - t0)
