"""Harbor's multi-step tasks: `[[steps]]` in task.toml, `steps/<name>/` beside it.

Concept (harbor 0.26, trial/multi_step.py, agents/oracle.py, verifier/verifier.py): the steps
run in order in one environment. Before step k the folder `steps/<name>/workdir/` is uploaded
into the working directory and its `setup.sh`, if any, runs there; the agent acts on
`steps/<name>/instruction.md` (after the step's `[steps.healthcheck]`, if any, passes; the oracle
runs `steps/<name>/solution/solve.sh`); the verifier, with the step's `[steps.verifier.env]`,
gets `tests/` and `steps/<name>/tests/` merged into /tests and runs the step's `test.sh`, else the
shared one. A step whose reward is below its `min_reward` (a number gates on `reward`, a table on
each named key, a missing key counting as -inf) ends the episode there. The episode's reward
(`multi_step_reward_strategy`): `mean` (the default) averages each key over the verified steps, a
key missing from a step counting 0; `final` is the last verified step's.

Invariant: a step's recorded rewards live in this process, keyed by sandbox id, never in the
sandbox, so no later step's agent can change them; the first step clears what an earlier episode
in a sandbox of the same id left.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from miles_env.adapters.harbor.config import HarborConfig
from miles_env.adapters.harbor.files import solution_script
from miles_env.adapters.harbor.templates import resolve_env
from miles_env.errors import TaskError

__all__ = ["StepLedger", "combine", "passes", "read_steps", "step_tests"]

_LEDGER_SIZE = 4096  # sandboxes remembered at once (each a few numbers)


def read_steps(
    task_dir: Path, cfg: HarborConfig, workdir: str, sol_env: dict[str, str]
) -> list[dict[str, Any]]:
    """The `[[steps]]` of task.toml with their folders checked; [] for a single-step task."""
    if not cfg.steps:
        return []
    seen: set[str] = set()
    out = []
    for s in cfg.steps:
        if s.name.casefold() in seen:
            raise TaskError(f"{task_dir / 'task.toml'}: steps: duplicate step name {s.name!r}")
        seen.add(s.name.casefold())
        sdir = task_dir / "steps" / s.name
        if not (sdir / "instruction.md").is_file():
            raise TaskError(f"{sdir / 'instruction.md'}: missing (step {s.name!r} of task.toml)")
        if not (sdir / "tests" / "test.sh").is_file() and not (task_dir / "tests" / "test.sh").is_file():
            raise TaskError(f"{sdir / 'tests' / 'test.sh'}: missing, and no shared tests/test.sh")
        out.append({
            "name": s.name,
            "instruction": (sdir / "instruction.md").read_text().strip() or s.name,
            "solution": solution_script(sdir / "solution", workdir, sol_env),
            "agent_timeout_s": s.agent.timeout_sec or cfg.agent.timeout_sec,
            "verifier_timeout_s": s.verifier.timeout_sec,
            "verifier_user": s.verifier.user_name or cfg.verifier.user_name,
            "verifier_env": resolve_env(s.verifier.env, f"{task_dir / 'task.toml'} [steps.verifier.env] of {s.name!r}"),
            "healthcheck": s.healthcheck.model_dump() if s.healthcheck else None,
            "min_reward": s.min_reward,
        })  # fmt: skip
    return out


def step_tests(task_dir: Path, step: str | None) -> tuple[list[Path], str]:
    """(folders merged into /tests, in order; the test script's path relative to /tests)."""
    shared = task_dir / "tests"
    if step is None:
        return [shared], "test.sh"
    own = task_dir / "steps" / step / "tests"
    dirs = [d for d in (shared, own) if d.is_dir()]
    return dirs, "test.sh"  # the step's own test.sh overwrites the shared one when it has one


def passes(rewards: dict[str, float], min_reward: float | dict[str, float] | None) -> bool:
    if min_reward is None:
        return True
    gates = {"reward": min_reward} if isinstance(min_reward, int | float) else min_reward
    return all(rewards.get(k, float("-inf")) >= v for k, v in gates.items())


def combine(steps: list[dict[str, float]], strategy: str) -> dict[str, float]:
    """The episode's rewards from the verified steps' (`mean` per key, missing = 0; or `final`)."""
    if not steps:
        return {}
    if strategy == "final":
        return dict(steps[-1])
    keys = {k for r in steps for k in r}
    return {k: sum(r.get(k, 0.0) for r in steps) / len(steps) for k in sorted(keys)}


class StepLedger:
    """Each sandbox's verified steps so far: (name, rewards) in order, and whether it stopped."""

    def __init__(self) -> None:
        self._rows: OrderedDict[str, list[tuple[str, dict[str, float]]]] = OrderedDict()
        self._stopped: set[str] = set()

    def begin(self, sandbox_id: str, first: bool) -> None:
        if first:
            self._rows.pop(sandbox_id, None)
            self._stopped.discard(sandbox_id)
        self._rows.setdefault(sandbox_id, [])
        self._rows.move_to_end(sandbox_id)
        while len(self._rows) > _LEDGER_SIZE:
            old, _ = self._rows.popitem(last=False)
            self._stopped.discard(old)

    def record(self, sandbox_id: str, step: str, rewards: dict[str, float], stopped: bool) -> None:
        self._rows.setdefault(sandbox_id, []).append((step, rewards))
        if stopped:
            self._stopped.add(sandbox_id)

    def done(self, sandbox_id: str) -> list[tuple[str, dict[str, float]]]:
        return list(self._rows.get(sandbox_id, []))

    def stopped(self, sandbox_id: str) -> bool:
        return sandbox_id in self._stopped
