"""Harbor task directories read natively and run in the real local sandbox (no harbor package)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from miles_env.adapters.harbor import HarborTasksEnvironment, parse_reward, rebase_paths
from miles_env.harnesses.builtin import BuiltinHarness
from miles_env.oracle import run_solution
from miles_env.registry import load_environment, validate_environment
from miles_env.types import Status
from tests.harbor_support import make_task

# The tasks build FROM ubuntu:24.04 / python:3.x-slim: the Debian bases they alias to (a lookup in CI).
pytestmark = pytest.mark.usefixtures("image_bases")


def test_rebase_and_reward_files() -> None:
    assert (
        rebase_paths("echo 1 > /logs/verifier/reward.txt") == "echo 1 > /tmp/harbor/logs/verifier/reward.txt"
    )
    assert rebase_paths("bash /tests/test.sh; cat /solution/x") == (
        "bash /tmp/harbor/tests/test.sh; cat /tmp/harbor/solution/x"
    )
    assert rebase_paths("/app/logs/x /usr/tests") == "/app/logs/x /usr/tests"
    assert parse_reward("0.5\n", None)[0] == 0.5
    assert parse_reward(None, '{"reward": 1, "style": 0}')[0] == 1.0
    assert parse_reward(None, '{"a": 1, "b": 0}')[0] == 0.5


def test_task_dir_is_read(tmp_path: Path) -> None:
    make_task(tmp_path)
    env = load_environment(f"harbor:{tmp_path}")
    assert isinstance(env, HarborTasksEnvironment)
    assert validate_environment(env) == {"test": 1}
    (task,) = env.tasks("test")
    assert task.id == "hello" and task.sandbox.workdir == "/app"
    assert task.sandbox.files == {}  # the Dockerfile's COPY runs in env.setup (test_adapters_harbor_setup.py)
    assert "bash /tmp/harbor/solution/solve.sh" in (task.solution or "")
    assert "test.sh" not in str(task.sandbox.files)  # tests are uploaded only at verify time


@pytest.mark.parametrize(("solution", "score"), [(None, 1.0), ("true", 0.0)])  # oracle, nop
def test_oracle_and_nop(tmp_path: Path, solution: str | None, score: float) -> None:
    from miles_env.sandboxes import get_provider

    make_task(tmp_path)
    env = load_environment(f"harbor:{tmp_path / 'hello'}")
    (task,) = env.tasks("test")
    res = anyio.run(run_solution, env, task, get_provider("local"), solution)
    assert res.error is None, res.error
    assert res.score == score, res.details


def test_agent_cannot_fake_the_reward(tmp_path: Path) -> None:
    from miles_env.sandboxes import get_provider

    make_task(tmp_path)
    env = load_environment(f"harbor:{tmp_path}")
    (task,) = env.tasks("test")
    cheat = "mkdir -p /tmp/harbor/logs/verifier && echo 1 > /tmp/harbor/logs/verifier/reward.txt"
    res = anyio.run(run_solution, env, task, get_provider("local"), cheat)
    assert res.score == 0.0


def test_builtin_harness_episode(tmp_path: Path) -> None:
    """A real episode: ScriptedEngine -> TITO -> builtin harness -> sandbox -> Harbor's test.sh."""
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    make_task(tmp_path)
    env = load_environment(f"harbor:{tmp_path}")
    (task,) = env.tasks("test")

    async def main() -> tuple[object, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(
            tok, ["```sh\nmkdir -p out && echo 'hello harbor' > out/hello.txt\n```", "DONE"]
        )
        async with open_stack(StackConfig(), engine=engine) as stack:
            ep = await run_episode(stack.rollout_context(env, BuiltinHarness()), task)
        return ep, engine

    ep, engine = anyio.run(main)
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 1.0
    sampled = [t for s in ep.samples for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    assert sampled == [t for g in engine.generations for t in g.output_ids]


@pytest.mark.slow
def test_harbor_own_trial_on_our_sandbox(tmp_path: Path) -> None:
    """Harbor's Trial (harbor venv) with our local sandbox as its environment (import_path)."""
    from miles_env.adapters.harbor import run_harbor_trial
    from miles_env.adapters.venv import install
    from miles_env.adapters.worker_pool import close_workers
    from miles_env.sandboxes import get_provider

    install("harbor")
    task_dir = make_task(tmp_path)

    async def main() -> list[dict]:
        provider = get_provider("local")
        out = [
            await run_harbor_trial(task_dir, agent, provider, trials_dir=tmp_path / "trials")
            for agent in ("oracle", "nop")
        ]
        await close_workers()
        return out

    oracle, nop = anyio.run(main)
    assert oracle["exception"] is None and oracle["rewards"] == {"reward": 1.0}
    assert nop["exception"] is None and nop["rewards"] == {"reward": 0.0}
    # Harbor's own record of the trial exists on disk.
    assert (Path(oracle["trial_uri"].removeprefix("file://")) / "result.json").is_file()


def test_split_override_for_training(tmp_path: Path) -> None:
    make_task(tmp_path)
    name = f"harbor:{tmp_path}?split=train"
    env = load_environment(name)
    assert validate_environment(env) == {"train": 1}
    (task,) = env.tasks("train")
    assert task.split == "train" and task.env == name and env.tasks("test") == []
