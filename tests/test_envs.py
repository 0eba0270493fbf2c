"""The built-in environments and the check language, through the real bubblewrap sandbox.

Needs the env packages installed:
pip install --no-deps -e envs/terminal-basics -e envs/terminal-hard
"""

from __future__ import annotations

import re
from collections import Counter

import anyio
import pytest

from miles_env.checks import parse_checks, run_checks
from miles_env.errors import TaskError
from miles_env.oracle import run_oracle
from miles_env.registry import load_environment
from miles_env.sandboxes import get_provider
from miles_env.types import SandboxSpec, Task

INSTALL = "pip install --no-deps -e envs/terminal-basics -e envs/terminal-hard"
ENVS = ("terminal-basics", "terminal-hard")


@pytest.fixture(scope="module")
def provider():
    return get_provider("local")


def _env(name: str):
    from importlib.metadata import entry_points

    if name not in {ep.name for ep in entry_points(group="miles_env.environments")}:
        pytest.fail(f"{name} is not installed; run: {INSTALL}")
    return load_environment(name)


# ---- what the environments contain --------------------------------------------------


def test_basics_splits_and_tiers_are_populated():
    env = _env("terminal-basics")
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) + len(test) >= 40
    assert len(train) >= 30 and len(test) >= 12
    for split, tasks in (("train", train), ("test", test)):
        tiers = Counter(t.metadata["tier"] for t in tasks)
        assert set(tiers) == {1, 2, 3, 4}, f"{split}: {tiers}"
        # the trainer learns mostly on tier 1 and the eval on test tier 1 is what moves
        assert tiers[1] >= (12 if split == "train" else 6), f"{split}: {tiers}"
        assert tiers[1] == max(tiers.values())
        assert all(t.split == split and t.env == "terminal-basics" for t in tasks)


def test_hard_has_about_twelve_tasks_in_both_splits():
    env = _env("terminal-hard")
    counts = Counter(t.split for t in env.tasks())
    assert counts["train"] >= 6 and counts["test"] >= 3 and 10 <= sum(counts.values()) <= 16


@pytest.mark.parametrize("name", ENVS)
def test_ids_are_unique_deterministic_and_every_task_is_complete(name):
    env = _env(name)
    tasks = env.tasks()
    ids = [t.id for t in tasks]
    assert len(ids) == len(set(ids))
    assert [t.id for t in load_environment(name).tasks()] == ids
    for t in tasks:
        assert t.solution and t.solution.strip(), t.id
        assert parse_checks(t).checks, t.id


_COMMANDS = {"echo", "touch", "mkdir", "cp", "mv", "rm", "wc", "sort", "uniq", "grep", "chmod", "sed",
             "awk", "head", "tail", "cat", "seq", "printf", "tr", "cut"}  # fmt: skip


def test_basics_instructions_say_what_not_how():
    for t in _env("terminal-basics").tasks():
        words = set(re.findall(r"[a-z]+", t.instruction))
        assert not words & _COMMANDS, f"{t.id}: instruction names a command: {words & _COMMANDS}"
        assert "`" not in t.instruction and len(t.instruction) < 300, t.id
        # the files it names are the files its checks grade (numbered-files names a range)
        if t.metadata["template"] == "numbered-files":
            continue
        for check in parse_checks(t).checks:
            if hasattr(check, "path"):
                assert check.path.split("/")[0] in t.instruction, (t.id, check.path)


# ---- oracle through the real sandbox ---------------------------------------------------


@pytest.mark.parametrize("name", ENVS)
def test_reference_solutions_all_pass(name, provider):
    env = _env(name)
    report = anyio.run(run_oracle, env, env.tasks(), provider, 4)
    assert report.n_total == len(env.tasks())
    assert report.failures == [], [(r.task_id, r.error, r.details) for r in report.failures]
    assert report.pass_rate == 1.0


@pytest.mark.parametrize("name", ENVS)
def test_empty_solution_fails_every_task(name, provider):
    env = _env(name)
    report = anyio.run(run_oracle, env, env.tasks(), provider, 4, "true")
    assert report.n_passed == 0, [r.task_id for r in report.results if r.passed]
    assert all(r.error is None and r.details["passed"] < r.details["total"] for r in report.results)


def test_wrong_content_fails_and_gets_partial_credit(provider):
    env = _env("terminal-basics")
    task = env.task("copy-file-1")  # two checks: the copy has the text, the source is intact
    report = anyio.run(run_oracle, env, [task], provider, 1, "echo wrong > backup.txt")
    (res,) = report.results
    assert not res.passed and res.score == 0.0
    assert res.details["fraction"] == 0.5
    failed = [c for c in res.details["checks"] if not c["passed"]]
    assert failed[0]["target"] == "backup.txt" and "wrong" in failed[0]["reason"]


# ---- the check language ---------------------------------------------------------------


def _task(checks, files=None, tid="t-1") -> Task:
    return Task(id=tid, env="test", instruction="x", sandbox=SandboxSpec(files=files or {}),
                verifier={"checks": checks})  # fmt: skip


async def _grade(provider, task: Task, setup: str = ""):
    async with await provider.create(task.sandbox) as sb:
        if setup:
            assert (await sb.exec(["bash", "-c", setup])).exit_code == 0
        return await run_checks(task, sb)


_FILES = {"a.txt": "hello\n", "run.sh": "#!/bin/sh\necho hi\n"}
_SETUP = "mkdir d && chmod 755 run.sh"
_CASES = [
    ({"kind": "file_exists", "path": "a.txt", "type": "file"}, True),
    ({"kind": "file_exists", "path": "a.txt", "type": "dir"}, False),
    ({"kind": "file_exists", "path": "d", "type": "dir"}, True),
    ({"kind": "file_exists", "path": "nope"}, False),
    ({"kind": "file_absent", "path": "nope"}, True),
    ({"kind": "file_absent", "path": "a.txt"}, False),
    ({"kind": "file_equals", "path": "a.txt", "text": "hello", "strip": True}, True),
    ({"kind": "file_equals", "path": "a.txt", "text": "hello"}, False),  # strict: newline matters
    ({"kind": "file_equals", "path": "a.txt", "text": "hello\n"}, True),
    ({"kind": "file_equals", "path": "nope", "text": ""}, False),
    ({"kind": "file_contains", "path": "a.txt", "text": "ell"}, True),
    ({"kind": "file_contains", "path": "a.txt", "text": "^h.*o$", "regex": True}, True),
    ({"kind": "file_contains", "path": "a.txt", "text": "bye"}, False),
    ({"kind": "file_contains", "path": "a.txt", "text": "bye", "negate": True}, True),
    ({"kind": "file_mode", "path": "run.sh", "executable": True}, True),
    ({"kind": "file_mode", "path": "run.sh", "mode": "755"}, True),
    ({"kind": "file_mode", "path": "a.txt", "executable": True}, False),
    ({"kind": "file_mode", "path": "a.txt", "mode": "600"}, False),
    ({"kind": "command", "cmd": "./run.sh", "stdout_equals": "hi"}, True),
    ({"kind": "command", "cmd": "./run.sh", "stdout_equals": "ho"}, False),
    ({"kind": "command", "cmd": "./run.sh", "stdout_contains": "h"}, True),
    ({"kind": "command", "cmd": "exit 3", "exit_code": 3}, True),
    ({"kind": "command", "cmd": "exit 3"}, False),
    ({"kind": "command", "cmd": "exit 3", "exit_code": None}, True),
    ({"kind": "command", "cmd": "sleep 5", "timeout": 0.5}, False),
]


def test_each_check_kind_passes_and_fails_inside_the_sandbox(provider):
    task = _task([c for c, _ in _CASES], _FILES)
    reward = anyio.run(_grade, provider, task, _SETUP)
    got = [row["passed"] for row in reward.details["checks"]]
    want = [ok for _, ok in _CASES]
    assert got == want, [
        (c, row["reason"]) for (c, _), row in zip(_CASES, reward.details["checks"], strict=True)
    ]
    assert reward.score == 0.0
    assert reward.details["fraction"] == pytest.approx(sum(want) / len(want))
    assert all(row["reason"] for row in reward.details["checks"])


def test_all_passing_checks_score_one(provider):
    task = _task([c for c, ok in _CASES if ok], _FILES)
    reward = anyio.run(_grade, provider, task, _SETUP)
    assert reward.score == 1.0 and reward.passed and reward.details["fraction"] == 1.0


def test_checks_run_inside_the_sandbox_not_on_the_host(provider, tmp_path):
    marker = tmp_path / "host-only.txt"
    marker.write_text("on the host\n")
    task = _task([{"kind": "file_exists", "path": str(marker)},
                  {"kind": "command", "cmd": f"test -e {marker}", "exit_code": 1}])  # fmt: skip
    reward = anyio.run(_grade, provider, task)
    assert [row["passed"] for row in reward.details["checks"]] == [False, True]


@pytest.mark.parametrize(
    ("checks", "field"),
    [
        ([{"kind": "file_equals", "path": "a.txt"}], "verifier.checks[0].file_equals.text"),
        ([{"kind": "file_exists", "path": "a", "colour": 1}], "verifier.checks[0].file_exists.colour"),
        ([{"kind": "file_exists", "path": "a"}, {"kind": "teleport"}], "verifier.checks[1]"),
        ([{"kind": "file_mode", "path": "a", "mode": "999"}], "verifier.checks[0].file_mode.mode"),
        ([], "verifier.checks"),
    ],
)
def test_malformed_check_names_task_and_field(checks, field):
    with pytest.raises(TaskError) as exc:
        parse_checks(_task(checks, tid="bad-task-7"))
    assert "'bad-task-7'" in str(exc.value) and field in str(exc.value)
