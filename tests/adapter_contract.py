"""The contract every worker-backed adapter (a `WorkerEnvironment`) must meet, as a reusable test class.

Use: subclass `AdapterContract` in a test module and define a `case` fixture
returning an `AdapterCase` (the adapter, one of its example environments, a task
and the scripted model reply that earns it reward 1, a reference that does not
exist), after installing (or reusing) the adapter's venv:

    class TestWorkerAdapters(AdapterContract):
        @pytest.fixture(params=CASES, ids=lambda c: c.adapter)
        def case(self, request): install(request.param.adapter); return request.param

Behaviours: the environment is found by its prefix in `ADAPTERS` and lists valid
tasks that carry their adapter; one episode through the real rollout (scripted
engine, real TITO proxy, real bubblewrap sandbox, the framework's own code in its
venv) reaches the framework's reward with every sampled token the engine's, and
leaves no worker process; a worker that crashes makes a FAILED episode with the
error kept, and the next episode of the same run completes; a reference that does
not exist is a one-line error naming it (when listing needs no worker, as for
OpenEnv's seeds, the episode's worker reports it and the episode fails).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from miles_env.adapters import ADAPTERS
from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.adapters.worker_pool import _POOL, close_workers
from miles_env.environment import Environment
from miles_env.errors import MilesEnvError
from miles_env.registry import load_environment, validate_environment
from miles_env.types import Episode, Status, Task

__all__ = ["AdapterCase", "AdapterContract", "live_cmdlines"]

CRASHING_WORKER = """
import os, sys
sys.path.insert(0, {workers!r})
import _rpc

async def crash(p):
    os._exit(3)

_rpc.serve({{m: crash for m in ("tasks", "run", "info", "reset", "step", "close")}}, {{"framework": "crash"}})
"""


@dataclass(frozen=True)
class AdapterCase:
    adapter: str  # the ADAPTERS prefix, e.g. "hud"
    env_name: str  # an example environment, e.g. "hud:/.../examples/hud_say_word.py"
    pick: Callable[[Task], bool]  # the task the episode runs
    reply: str  # the scripted model reply that earns that task reward 1.0
    bad_name: str  # a reference to nothing
    bad_hint: str  # what the bad reference's error must mention


def live_cmdlines(needle: str) -> list[str]:
    """Command lines of live processes that contain `needle`."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(cmd)
    return out


def run_episodes(
    env: Environment,
    tasks: Sequence[Task],
    replies: Sequence[str],
    *,
    isolation: str = "sandbox",
    before: Callable[[int], None] = lambda i: None,
) -> tuple[list[Episode], Any]:
    """The tasks' episodes, one after another, in one stack (scripted engine, framework harness)."""
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses import get_harness
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    async def main() -> tuple[list[Episode], ScriptedEngine]:
        engine = ScriptedEngine(load_tokenizer("smollm2"), list(replies))
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework", isolation=isolation))
            episodes = []
            for i, task in enumerate(tasks):
                before(i)
                episodes.append(await run_episode(ctx, task))
        await close_workers()
        return episodes, engine

    return anyio.run(main)


def sampled_ids(episodes: Sequence[Episode]) -> list[int]:
    return [
        t for ep in episodes for s in ep.samples for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m
    ]


class AdapterContract:
    """Subclass and provide a `case` fixture (see the module docstring)."""

    def _env_and_task(self, case: AdapterCase) -> tuple[WorkerEnvironment, Task]:
        env = load_environment(case.env_name)
        assert isinstance(env, WorkerEnvironment)
        return env, next(t for t in env.tasks() if case.pick(t))

    def test_lists_valid_tasks_by_its_prefix(self, case: AdapterCase) -> None:
        env = load_environment(case.env_name)
        assert isinstance(env, WorkerEnvironment) and type(env) is ADAPTERS.load(case.adapter)
        assert env.adapter == case.adapter
        counts = validate_environment(env)
        assert sum(counts.values()) == len(env.tasks()) > 0
        for task in env.tasks():
            assert task.env == env.name and task.metadata["adapter"] == case.adapter
            assert env.episode_args(task)  # an episode can start its worker from the task alone
        assert sum(1 for t in env.tasks() if case.pick(t)) == 1

    def test_episode_reaches_the_framework_reward_and_closes_its_worker(self, case: AdapterCase) -> None:
        env, task = self._env_and_task(case)
        (ep,), engine = run_episodes(env, [task], [case.reply])
        assert ep.status is Status.COMPLETED, ep.error
        assert ep.score == 1.0 and ep.reward is not None
        assert sampled_ids([ep]) == [t for g in engine.generations for t in g.output_ids] != []
        args = type(env).episode_args(task)
        assert not live_cmdlines(f"{env.script} {args[0]}")  # the episode's worker is gone

    def test_worker_crash_is_a_failed_episode_and_the_run_goes_on(
        self, case: AdapterCase, tmp_path: Path
    ) -> None:
        env, task = self._env_and_task(case)
        script = tmp_path / "crashing_worker.py"
        script.write_text(CRASHING_WORKER.format(workers=str(WORKERS_DIR)))
        args = type(env).episode_args(task)
        key = (env.adapter, env.script, "\0".join(args))

        def before(i: int) -> None:
            # isolation "none": the pooled host worker for this task is the crashing one at first
            _POOL.pop(key, None)
            if i == 0:
                _POOL[key] = WorkerClient([sys.executable, "-u", str(script)], name=env.adapter)

        try:
            (crashed, ok), _ = run_episodes(env, [task, task], [case.reply], isolation="none", before=before)
        finally:
            _POOL.pop(key, None)
        assert crashed.status is Status.FAILED and crashed.score == 0.0
        assert "exited with code 3" in (crashed.error or "")
        assert ok.status is Status.COMPLETED and ok.score == 1.0, ok.error
        assert not live_cmdlines(str(script)) and not live_cmdlines(f"{env.script} {args[0]}")

    def test_bad_reference_is_a_one_line_error(self, case: AdapterCase) -> None:
        try:
            env = load_environment(case.bad_name)
        except MilesEnvError as e:
            message = str(e)
            assert "\n" not in message and case.bad_name in message, message
        else:  # listing needed no worker (OpenEnv seeds): the episode's worker meets the bad reference
            (ep,), _ = run_episodes(env, env.tasks()[:1], [case.reply])
            assert ep.status is Status.FAILED
            message = ep.error or ""
        assert case.bad_hint in message, message
