"""Reward-hacking guards: what an episode's agent may not do to earn its reward, checked per episode.

Concept: `Guard.start` runs right after `Environment.setup` and keeps the starting state (the
protected paths' bytes, the git objects; state.py). After the harness stopped, `inspect` runs the
detectors and returns the episode's flags with their evidence:
  - `test_edit`: a protected path (`Environment.protected_paths`, the task's test files by
    default) differs from its start, read through the provider (state.py);
  - `git_history`: a recorded command reached for history outside the starting state
    (`git log --all`, `git reflog`, `git cat-file`, `cat .git/packed-refs`, an unknown object id);
  - `package_install`: a recorded command installs or downloads (pip, npm, apt, curl, wget, ...),
    attempts included (commands.py says what command text can and cannot show).
Then `verify` grades where the environment says (`Environment.verify_in`: `same`, the agent's
sandbox after it stopped, or `fresh`, a new sandbox holding only its final workspace; fresh.py),
after writing the protected files back as they were, and sets the reward to 0 when a flag listed
in `GuardsConfig.zero_reward_on` was raised (the original score stays in `details["guards"]`).
`scrub_git` (git.py) is the setup helper that takes a repository's future away.

Limits, honestly: the command detectors see only what a harness recorded (commands.py); a
`same` verify on docker runs beside whatever the agent left running in its container (local
execs leave nothing: each one's pid namespace dies with it), which `fresh` avoids; `fresh` does
not rerun `setup`, so a verifier that needs what setup put outside the workdir wants `same`.

Invariant: a guard never raises for what the agent did (that is a flag); a sandbox failure while
guarding is the episode's FAILED status like any other. With `enabled: false` it is a plain
`env.verify` in the same sandbox. The network side (only the TITO bridge) is the provider's:
`NetworkPolicy.NONE` by default, tested in tests/test_guards.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_env.environment import Environment, Transcript
from miles_env.errors import ConfigError
from miles_env.guards.commands import commands_of, git_history_reads, package_installs
from miles_env.guards.config import FLAGS, GuardsConfig
from miles_env.guards.fresh import fresh_copy
from miles_env.guards.git import scrub_git
from miles_env.guards.state import StartState, changed_paths, restore, snapshot
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import Reward, SandboxSpec, Task

__all__ = ["FLAGS", "Guard", "GuardReport", "GuardsConfig", "scrub_git", "zero_flagged"]

_WHERE = ("same", "fresh")


@dataclass(frozen=True, slots=True)
class GuardReport:
    flags: tuple[str, ...] = ()
    evidence: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def zero_flagged(reward: Reward | None, flags: tuple[str, ...], config: GuardsConfig) -> Reward | None:
    """`reward` with score 0 when a flag is in `config.zero_reward_on` (the score is kept in details)."""
    hit = [f for f in flags if f in config.zero_reward_on]
    if reward is None or not hit:
        return reward
    note = {"zeroed_by": hit, "score": reward.score}
    return Reward(score=0.0, details={**reward.details, "guards": note})


class Guard:
    """One episode's guard; build it with `await Guard.start(...)` after `env.setup`."""

    def __init__(
        self,
        config: GuardsConfig,
        env: Environment,
        task: Task,
        provider: SandboxProvider,
        start: StartState | None,
        spec: SandboxSpec | None = None,
    ) -> None:
        self.config, self.env, self.task, self.provider, self.start_state = config, env, task, provider, start
        self.spec = spec if spec is not None else env.sandbox_spec(task)  # what a fresh sandbox is made of
        self.timings: dict[str, float] = {}
        self.report = GuardReport()
        self._changed: list[dict[str, str | None]] = []
        where = config.verify_in if config.verify_in != "env" else env.verify_in
        if where not in _WHERE:
            raise ConfigError(f"{type(env).__name__}.verify_in={where!r}: must be one of {list(_WHERE)}")
        self.verify_in = where if config.enabled else "same"

    @classmethod
    async def start(
        cls,
        config: GuardsConfig,
        env: Environment,
        task: Task,
        sandbox: Sandbox,
        provider: SandboxProvider,
        spec: SandboxSpec | None = None,
    ) -> Guard:
        """Keep the starting state of `sandbox` (made from `spec`, default `env.sandbox_spec(task)`)."""
        if not config.enabled:
            return cls(config, env, task, provider, None, spec)
        t0 = time.perf_counter()
        protected = list(env.protected_paths(task))
        state = await snapshot(sandbox, protected, git="git_history" in config.detectors)
        guard = cls(config, env, task, provider, state, spec)
        guard.timings["guard_snapshot_s"] = time.perf_counter() - t0
        return guard

    async def inspect(self, sandbox: Sandbox, harness_metadata: Mapping[str, Any]) -> GuardReport:
        """Run the detectors on the sandbox the agent left and on its recorded commands."""
        if self.start_state is None:
            return self.report
        t0 = time.perf_counter()
        on = self.config.detectors
        evidence: dict[str, list[dict[str, Any]]] = {}
        if "test_edit" in on or self.config.restore_protected:
            self._changed = await changed_paths(sandbox, self.start_state)
            if "test_edit" in on and self._changed:
                evidence["test_edit"] = [dict(r) for r in self._changed]
        execs = commands_of(harness_metadata)
        if "git_history" in on and (rows := git_history_reads(execs, self.start_state.git_objects)):
            evidence["git_history"] = rows
        if "package_install" in on and (rows := package_installs(execs)):
            evidence["package_install"] = rows
        self.report = GuardReport(tuple(f for f in FLAGS if f in evidence), evidence)
        self.timings["guard_inspect_s"] = time.perf_counter() - t0
        return self.report

    async def verify(self, sandbox: Sandbox, transcript: Transcript) -> Reward:
        """`env.verify` where the environment says, protected files restored, flagged rewards zeroed."""
        if self.start_state is None:
            return await self.env.verify(self.task, sandbox, transcript)
        if self.verify_in == "fresh":
            t0 = time.perf_counter()
            async with await fresh_copy(self.provider, self.spec, sandbox) as fresh:
                self.timings["guard_fresh_s"] = time.perf_counter() - t0
                reward = await self._restored_verify(fresh, transcript)
        else:
            reward = await self._restored_verify(sandbox, transcript)
        zeroed = zero_flagged(reward, self.report.flags, self.config)
        assert zeroed is not None
        return zeroed

    async def _restored_verify(self, sandbox: Sandbox, transcript: Transcript) -> Reward:
        if self.config.restore_protected and self._changed and self.start_state is not None:
            await restore(sandbox, self.start_state, self._changed)
        return await self.env.verify(self.task, sandbox, transcript)
