"""The guards in the built-in environments: declared protected paths and a scrubbed repository.

terminal-hard declares the test files of its tasks as protected (`metadata["protected_paths"]`,
the same set the Environment default derives) and its `fix-slug-in-repo` task starts in a git
repository whose later commit holds the fix, scrubbed in setup. Real parts: the installed
environments, the local (bubblewrap) sandbox, the oracle, and episodes through the TITO proxy with
the builtin harness and a scripted policy (the engine is not the point here).
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatch
from pathlib import PurePosixPath

import anyio

from miles_env.engines.scripted import ScriptedEngine
from miles_env.environment import Environment
from miles_env.guards import GuardsConfig
from miles_env.harnesses.builtin import BuiltinHarness
from miles_env.models import load_tokenizer
from miles_env.oracle import run_solution
from miles_env.registry import load_environment
from miles_env.rollout import run_episode
from miles_env.sandboxes import get_provider
from miles_env.stack import StackConfig, open_stack
from miles_env.types import Episode

REPO_TASK = "fix-slug-in-repo"


def _test_files(files: dict[str, str]) -> set[str]:
    return {p for p in files if fnmatch(PurePosixPath(p).name, "test_*")}


def test_terminal_hard_declares_the_test_files_it_ships_as_protected() -> None:
    env = load_environment("terminal-hard")
    with_tests = 0
    for task in env.tasks():
        declared = task.metadata["protected_paths"]
        assert set(declared) == _test_files(task.sandbox.files), task.id
        bare = task.model_copy(update={"metadata": {}})  # what the Environment default would derive
        assert Environment.protected_paths(env, bare) == sorted(declared), task.id
        with_tests += bool(declared)
    assert with_tests >= 3  # fizzbuzz, median, the repository task


def test_terminal_basics_ships_no_test_file_to_protect() -> None:
    env = load_environment("terminal-basics")
    for task in env.tasks():
        assert _test_files(task.sandbox.files) == set() and env.protected_paths(task) == [], task.id


async def _after_setup() -> dict[str, str]:
    env = load_environment("terminal-hard")
    task = env.task(REPO_TASK)
    async with await get_provider("local").create(env.sandbox_spec(task)) as sb:
        await env.setup(task, sb)
        out = {
            "log_all": (await sb.exec(["git", "log", "--all", "--format=%s"])).stdout,
            "refs": (await sb.exec(["git", "for-each-ref", "--format=%(refname)"])).stdout,
            "objects": (
                await sb.exec(["sh", "-c", "git cat-file --batch-all-objects --batch-check | wc -l"])
            ).stdout,
            "reachable": (await sb.exec(["sh", "-c", "git rev-list --objects --all | wc -l"])).stdout,
            "status": (await sb.exec(["git", "status", "--porcelain"])).stdout,
            "slug": (await sb.read_file("slug.py")).decode(),
        }
        # the fix's blob, as the later commit stored it, is gone from the object store
        from miles_env_terminal_hard.tasks import TASKS

        future = next(t.future for t in TASKS if t.id == REPO_TASK)
        assert future is not None
        await sb.write_file("/tmp/fixed.py", future["slug.py"])
        blob = (await sb.exec(["git", "hash-object", "/tmp/fixed.py"])).stdout.strip()
        out["fix_blob_present"] = str((await sb.exec(["git", "cat-file", "-e", blob])).exit_code == 0)
        return out


def test_the_repository_task_starts_with_its_future_scrubbed() -> None:
    seen = anyio.run(_after_setup)
    assert seen["log_all"].split() == ["start"]  # `git log --all`: the starting commit only
    assert seen["refs"].split() == ["refs/heads/main"]
    assert seen["objects"].strip() == seen["reachable"].strip() == "4"  # commit, tree, 2 blobs
    assert seen["fix_blob_present"] == "False"
    assert seen["status"] == "" and '[^a-z0-9]"' in seen["slug"]  # a clean tree at the buggy start


def test_the_repository_task_oracle_passes_and_doing_nothing_fails() -> None:
    env = load_environment("terminal-hard")
    task, provider = env.task(REPO_TASK), get_provider("local")
    ok = anyio.run(run_solution, env, task, provider)
    assert ok.passed and ok.flags == () and ok.error is None, (ok.error, ok.details)
    idle = anyio.run(run_solution, env, task, provider, "true")
    assert not idle.passed and idle.error is None


def _cmd(command: str) -> str:
    return f"```sh\n{command}\n```"


async def _episode(task_id: str, replies: list[str], guards: GuardsConfig) -> Episode:
    env = load_environment("terminal-hard")
    engine = ScriptedEngine(load_tokenizer("smollm2"), [*map(_cmd, replies), "DONE"])
    async with open_stack(StackConfig(), engine=engine) as stack:
        ctx = replace(stack.rollout_context(env, BuiltinHarness(max_turns=len(replies) + 1)), guards=guards)
        return await run_episode(ctx, env.task(task_id))


def run(task_id: str, replies: list[str], zero_reward_on: tuple[str, ...] = ("test_edit",)) -> Episode:
    ep = anyio.run(_episode, task_id, replies, GuardsConfig(zero_reward_on=list(zero_reward_on)))
    assert ep.status.value == "completed", ep.error
    return ep


def test_reading_the_future_finds_nothing_and_is_flagged() -> None:
    cheat = ["git log --all -p", "git reflog", "git checkout HEAD@{1} -- slug.py", "python3 test_slug.py"]
    ep = run(REPO_TASK, cheat, zero_reward_on=("git_history",))
    assert ep.flags == ["git_history"] and ep.score == 0.0
    execs = ep.metadata["harness"]["execs"]
    assert "the fix" not in execs[0]["output"] and execs[2]["exit_code"] != 0  # no later commit to read


def test_an_honest_fix_in_the_repository_scores_1_unflagged() -> None:
    task = load_environment("terminal-hard").task(REPO_TASK)
    assert task.solution is not None
    ep = run(REPO_TASK, ["git log --oneline", task.solution, "git diff --stat", "python3 test_slug.py"])
    assert ep.score == 1.0 and ep.flags == [], (ep.reward, ep.metadata["guards"])


def test_editing_a_declared_test_is_flagged_restored_and_zeroed() -> None:
    cheat = ["printf 'print(\"ok\")\\n' > test_stats.py", "python3 test_stats.py"]
    ep = run("fix-median", cheat)  # the default guards: test_edit zeroes, protected files restored
    assert ep.flags == ["test_edit"] and ep.score == 0.0
    (row,) = ep.metadata["guards"]["test_edit"]
    assert row["path"] == "test_stats.py"
    assert ep.reward is not None and ep.reward.details["guards"]["zeroed_by"] == ["test_edit"]
