"""HUD: a real hud.v1 taskset (adapters/examples/hud_say_word.py, ours) in its own venv."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

import miles_env.adapters as adapters_pkg
from miles_env.adapters.worker_pool import close_workers
from miles_env.harnesses import get_harness
from miles_env.registry import load_environment
from miles_env.types import Status

SAY = Path(adapters_pkg.__file__).parent / "examples" / "hud_say_word.py"


@pytest.mark.slow
def test_hud_episode_reward_and_tokens() -> None:
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("hud")
    env = load_environment(f"hud:{SAY}")
    by_id = {t.id: t for t in env.tasks("test")}
    by_word = {t.metadata["args"]["word"]: t for t in by_id.values()}
    assert sorted(by_word) == ["apple", "cloud", "river", "stone"]

    async def main() -> tuple[list, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(tok, ["river it is", "I will not"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, get_harness("framework"))
            eps = [await run_episode(ctx, by_word["river"]), await run_episode(ctx, by_word["apple"])]
        await close_workers()
        return eps, engine

    (ep_hit, ep_miss), engine = anyio.run(main)
    assert ep_hit.status is Status.COMPLETED, ep_hit.error
    assert ep_hit.score == 1.0 and ep_hit.reward is not None
    assert ep_hit.reward.details["error"] is None  # HUD graded it: the template's own reward
    assert ep_miss.status is Status.COMPLETED and ep_miss.score == 0.0
    sampled = [
        t
        for ep in (ep_hit, ep_miss)
        for s in ep.samples
        for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        if m
    ]
    assert sampled and sampled == [t for g in engine.generations for t in g.output_ids]


def _env_without_tasks(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "env.py").write_text(
        "\n".join(line for line in SAY.read_text().splitlines() if not line.startswith("tasks = "))
    )
    return folder / "env.py"


def _episode(env_file: Path, word: str, reply: str):  # type: ignore[no-untyped-def]
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    env = load_environment(f"hud:{env_file}")
    task = {t.metadata["args"]["word"]: t for t in env.tasks("test")}[word]

    async def main():  # type: ignore[no-untyped-def]
        engine = ScriptedEngine(load_tokenizer("smollm2"), [reply])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ep = await run_episode(stack.rollout_context(env, get_harness("framework")), task)
        await close_workers()
        return ep

    return env, anyio.run(main)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["sibling module", "tasks.json"])
def test_tasks_defined_elsewhere_are_found(tmp_path: Path, where: str) -> None:
    """Before: env.py without a Taskset of its own listed 0 tasks, silently."""
    from miles_env.adapters.venv import install

    install("hud")
    env_file = _env_without_tasks(tmp_path / "say")
    if where == "sibling module":
        (tmp_path / "say" / "tasks.py").write_text(
            "from env import say\nfrom hud.eval import Taskset\n\n"
            "tasks = Taskset('say-word', [say(word=w) for w in ('apple', 'river', 'stone')])\n"
        )
    else:
        rows = [{"env": "say-word", "id": "say", "args": {"word": w}} for w in ("apple", "river", "stone")]
        (tmp_path / "say" / "tasks.json").write_text(json.dumps(rows))
    env, ep = _episode(env_file, "river", "river")
    assert len(env.tasks("test")) == 3
    assert ep.status is Status.COMPLETED and ep.score == 1.0, ep.error


@pytest.mark.slow
def test_no_tasks_anywhere_says_where_it_looked(tmp_path: Path) -> None:
    from miles_env.adapters.venv import install
    from miles_env.errors import MilesEnvError

    install("hud")
    env_file = _env_without_tasks(tmp_path / "say")
    with pytest.raises(MilesEnvError, match=r"no HUD tasks found: none in env.py's globals, no tasks\*.json"):
        load_environment(f"hud:{env_file}").tasks("test")
    anyio.run(close_workers)


@pytest.mark.slow
@pytest.mark.parametrize(("word", "reply"), [("river", "river it is"), ("apple", "I will not")])
def test_parity_with_hud_grader(word: str, reply: str) -> None:
    """Our episode's reward equals HUD's own TaskRunner grading the same answer."""
    from miles_env.adapters.venv import install
    from miles_env.models import load_tokenizer
    from tests.adapter_parity import framework_score, reply_text

    install("hud")
    env, ep = _episode(SAY, word, reply)
    assert ep.status is Status.COMPLETED, ep.error
    task = {t.metadata["args"]["word"]: t for t in env.tasks("test")}[word]
    answer = reply_text(ep, load_tokenizer("smollm2"))
    theirs = framework_score(
        "hud",
        "hud_grade.py",
        {"env_file": str(SAY), "template": "say", "args": task.metadata["args"], "answer": answer},
    )
    assert ep.score == theirs["score"] == (1.0 if word in reply else 0.0)
