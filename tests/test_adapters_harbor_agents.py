"""Harbor's own LLM agent (terminus-2) in our sandbox, its model being a TITO session.

The policy is a ScriptedEngine that writes the exact JSON terminus-2's parser
expects; Harbor's verifier scores the task; the trajectory comes from the TITO
session. Needs the harbor venv (`miles-env adapters install harbor`) and tmux.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest

from miles_env.registry import load_environment
from miles_env.types import Status
from tests.harbor_support import TMUX_DOCKERFILE, make_task

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("image_bases"),  # the tasks build FROM ubuntu:24.04
    pytest.mark.skipif(shutil.which("tmux") is None, reason="terminus-2 drives a tmux terminal"),
]

SOLVE = "mkdir -p /app/out && echo 'hello harbor' > /app/out/hello.txt\n"


def terminus_reply(keystrokes: list[str], done: bool, duration: float = 0.3) -> str:
    """One reply in terminus-2's JSON format (harbor/agents/terminus_2/templates/terminus-json-plain.txt)."""
    commands = [{"keystrokes": k, "duration": duration} for k in keystrokes]
    return json.dumps({"analysis": "a", "plan": "p", "commands": commands, "task_complete": done})


def run(tmp_path: Path, replies: list[str], **harness_cfg: Any) -> tuple[Any, Any]:
    from miles_env.adapters.framework_harness import FrameworkHarness
    from miles_env.adapters.venv import install
    from miles_env.adapters.worker_pool import close_workers
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("harbor")
    make_task(tmp_path, dockerfile=TMUX_DOCKERFILE)
    env = load_environment(f"harbor:{tmp_path}")
    (task,) = env.tasks("test")

    async def main() -> tuple[Any, ScriptedEngine]:
        engine = ScriptedEngine(load_tokenizer("smollm2"), replies)
        try:
            async with open_stack(StackConfig(), engine=engine) as stack:
                harness = FrameworkHarness(trials_dir=str(tmp_path / "trials"), **harness_cfg)
                ep = await run_episode(stack.rollout_context(env, harness), task)
        finally:
            await close_workers()
        return ep, engine

    return anyio.run(main)


def sampled_ids(ep: Any) -> list[int]:
    return [t for s in ep.samples for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]


def test_terminus2_solves_through_tito(tmp_path: Path) -> None:
    # terminus-2 asks for confirmation after the first task_complete: two replies.
    ep, engine = run(tmp_path, [terminus_reply([SOLVE], True), terminus_reply([], True)])
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 1.0, ep.reward
    assert ep.reward.details["rewards"] == {"reward": 1.0}  # Harbor's own verifier
    assert len(engine.generations) == 2
    assert sampled_ids(ep) == [t for g in engine.generations for t in g.output_ids]
    # The prompt the policy saw is terminus-2's, with the task's instruction in it.
    prompt = engine.tokenizer.decode(list(engine.calls[0].input_ids))
    assert "Format your response as JSON" in prompt and "hello harbor" in prompt
    trial = Path(ep.reward.details["trial_uri"].removeprefix("file://"))
    assert (trial / "result.json").is_file()


def test_terminus2_doing_nothing_scores_zero(tmp_path: Path) -> None:
    ep, engine = run(tmp_path, [terminus_reply(["ls\n"], True), terminus_reply([], True)])
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 0.0 and ep.reward.details["rewards"] == {"reward": 0.0}
    assert sampled_ids(ep) == [t for g in engine.generations for t in g.output_ids]


def test_terminus2_turn_budget_ends_the_agent(tmp_path: Path) -> None:
    """Unparseable replies: terminus-2 retries until max_turns; Harbor still verifies (reward 0)."""
    ep, engine = run(tmp_path, ["not json"] * 3, max_turns=3)
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 0.0
    assert len(engine.generations) == 3
    assert sampled_ids(ep) == [t for g in engine.generations for t in g.output_ids]


def test_terminus2_timeout_is_truncated(tmp_path: Path) -> None:
    """Harbor's agent timeout ends the episode as TRUNCATED; Harbor still verifies (reward 0)."""
    ep, engine = run(tmp_path, [terminus_reply(["sleep 30\n"], False, duration=20)], agent_timeout_s=3)
    assert ep.status is Status.TRUNCATED, (ep.status, ep.error)
    assert "timed out" in (ep.error or "")
    assert ep.score == 0.0 and ep.reward.details["rewards"] == {"reward": 0.0}
    assert sampled_ids(ep) == [t for g in engine.generations for t in g.output_ids]


def test_unknown_harbor_agent_fails_the_episode(tmp_path: Path) -> None:
    ep, engine = run(tmp_path, [], agent="no-such-agent")
    assert ep.status is Status.FAILED and "no-such-agent" in (ep.error or ""), ep.error
    assert engine.generations == [] and ep.score == 0.0


def test_cli_eval_with_real_smollm2(tmp_path: Path) -> None:
    """`miles-env eval --env harbor:... --harness framework` with the real model: a status and a trajectory."""
    import subprocess
    import sys

    from miles_env.adapters.venv import install

    install("harbor")
    make_task(tmp_path / "tasks", dockerfile=TMUX_DOCKERFILE)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "miles_env.cli.main", "eval", "--env", f"harbor:{tmp_path / 'tasks'}"]
    cmd += ["--harness", "framework", "--harness-opt", "agent=terminus-2", "--harness-opt", "max_tokens=48"]
    cmd += ["--harness-opt", "agent_timeout_s=25", "--max-turns", "2", "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (episode,) = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert episode["status"] in ("completed", "truncated"), episode["error"]
    assert episode["reward"]["details"]["rewards"] is not None  # Harbor's verifier ran
    sample = episode["samples"][0]
    assert sum(sample["loss_mask"]) > 0 and len(sample["turns"]) >= 1


@pytest.mark.parametrize(("agent", "score"), [("oracle", 1.0), ("nop", 0.0)])
def test_framework_harness_with_harbor_oracle_and_nop(tmp_path: Path, agent: str, score: float) -> None:
    """Agents without a model (no inference endpoint option) run too; no model call is made."""
    ep, engine = run(tmp_path, [], agent=agent)
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == score and engine.generations == []
