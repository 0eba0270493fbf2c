"""OpenEnv: a real openenv-core env server (adapters/examples/openenv_guess.py, ours) in its own venv."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import miles_env.adapters as adapters_pkg
from miles_env.adapters.worker_pool import close_workers
from miles_env.harnesses import get_harness
from miles_env.registry import load_environment
from miles_env.types import Status

GUESS = Path(adapters_pkg.__file__).parent / "examples" / "openenv_guess.py"


@pytest.mark.slow
def test_openenv_episode_reward_and_tokens() -> None:
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("openenv")
    env = load_environment(f"openenv:{GUESS}:app")
    by_id = {t.id: t for t in env.tasks()}
    hit, miss = by_id["seed-1"], by_id["seed-0"]  # seed 1 -> "river", seed 0 -> "apple"

    async def main() -> tuple[list, ScriptedEngine]:
        tok = load_tokenizer("smollm2")
        engine = ScriptedEngine(tok, ["I say river", "nope", "no", "still no"])
        harness = get_harness("framework")
        async with open_stack(StackConfig(), engine=engine) as stack:
            ctx = stack.rollout_context(env, harness)
            eps = [await run_episode(ctx, hit), await run_episode(ctx, miss)]
        await close_workers()
        return eps, engine

    (ep_hit, ep_miss), engine = anyio.run(main)
    assert ep_hit.status is Status.COMPLETED, ep_hit.error
    assert ep_hit.score == 1.0 and ep_hit.reward is not None
    assert ep_hit.reward.details["steps"] == 1
    assert ep_miss.score == 0.0 and ep_miss.reward is not None and ep_miss.reward.details["steps"] == 3
    # What the model sampled is exactly what the engine produced, in order, across both episodes.
    sampled = [
        t
        for ep in (ep_hit, ep_miss)
        for s in ep.samples
        for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        if m
    ]
    assert sampled == [t for g in engine.generations for t in g.output_ids]


GARBAGE_WORKER = """
import sys
sys.path.insert(0, {workers!r})
import _rpc

async def anything(p):
    _rpc._out.write("<html>500 Internal Server Error</html>\\n")
    _rpc._out.flush()
    return None

_rpc.serve({{"info": anything, "reset": anything, "step": anything, "close": anything}})
"""


@pytest.mark.slow
def test_broken_worker_fails_its_episode_and_the_run_goes_on(tmp_path: Path) -> None:
    """run_many over [broken worker, real worker]: the first episode fails with the error, the second passes."""
    import sys

    from miles_env.adapters.venv import install
    from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient
    from miles_env.adapters.worker_pool import _POOL
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_many
    from miles_env.stack import StackConfig, open_stack

    install("openenv")
    env = load_environment(f"openenv:{GUESS}:app")
    good = {t.id: t for t in env.tasks()}["seed-1"]
    bad = good.model_copy(update={"id": "broken", "metadata": {**good.metadata, "target": "BROKEN"}})
    script = tmp_path / "garbage_worker.py"
    script.write_text(GARBAGE_WORKER.format(workers=str(WORKERS_DIR)))
    _POOL[("openenv", "openenv_worker.py", "BROKEN")] = WorkerClient([sys.executable, "-u", str(script)])

    async def main() -> list:
        engine = ScriptedEngine(load_tokenizer("smollm2"), ["river"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            # isolation=none: the pooled host worker is the one replaced by the garbage script
            ctx = stack.rollout_context(env, get_harness("framework", isolation="none"))
            eps = await run_many(ctx, [bad, good], concurrency=2)
        await close_workers()
        return eps

    try:
        eps = {e.task_id: e for e in anyio.run(main)}
    finally:
        _POOL.pop(("openenv", "openenv_worker.py", "BROKEN"), None)
    assert eps["broken"].status is Status.FAILED
    assert "protocol error: not JSON" in (eps["broken"].error or "")
    assert eps["broken"].score == 0.0
    assert eps["seed-1"].status is Status.COMPLETED, eps["seed-1"].error
    assert eps["seed-1"].score == 1.0


def _init_layout(root: Path) -> Path:
    """The `openenv init` layout: models.py at the root, server/app.py importing its siblings."""
    src = GUESS.read_text()
    models, _, env_part = src.partition("class GuessEnv(Environment):")
    (root / "server").mkdir(parents=True)
    (root / "openenv.yaml").write_text(
        "spec_version: 1\nname: guess\ntype: space\nruntime: fastapi\napp: server.app:app\n"
    )
    (root / "__init__.py").write_text("")
    (root / "server" / "__init__.py").write_text("")
    (root / "models.py").write_text(models.split("def app()")[0])
    (root / "server" / "guess_environment.py").write_text(
        "from typing import Any\nfrom openenv.core.env_server.interfaces import Environment\n"
        "from openenv.core.env_server.types import State\n"
        "try:\n    from ..models import WORDS, GuessAction, GuessObservation\nexcept ImportError:\n"
        "    from models import WORDS, GuessAction, GuessObservation\n\n\n"
        "class GuessEnv(Environment):" + env_part.split("def app()")[0]
    )
    (root / "server" / "app.py").write_text(
        "from openenv.core.env_server.http_server import create_app\n"
        "try:\n    from ..models import GuessAction, GuessObservation\n"
        "    from .guess_environment import GuessEnv\nexcept ImportError:\n"
        "    from models import GuessAction, GuessObservation\n    from server.guess_environment import GuessEnv\n"
        "app = create_app(GuessEnv, GuessAction, GuessObservation, env_name='guess', max_concurrent_envs=8)\n"
    )
    return root / "server" / "app.py"


def test_project_root_of_the_init_layout(tmp_path: Path) -> None:
    from miles_env.adapters.openenv import OpenEnvEnvironment, project_root

    app = _init_layout(tmp_path / "guess")
    assert project_root(app) == tmp_path / "guess"
    assert OpenEnvEnvironment.mounts((f"{app}:app",)) == [str(tmp_path / "guess")]
    assert project_root(GUESS) == GUESS.parent  # no openenv.yaml: the file's own folder


@pytest.mark.slow
def test_openenv_init_layout_imports_its_siblings(tmp_path: Path) -> None:
    """Before: only server/ was mounted and nothing put on sys.path, so `from models import` failed."""
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    install("openenv")
    env = load_environment(f"openenv:{_init_layout(tmp_path / 'guess')}:app")
    task = {t.id: t for t in env.tasks()}["seed-1"]  # "river"

    async def main():  # type: ignore[no-untyped-def]
        engine = ScriptedEngine(load_tokenizer("smollm2"), ["river"])
        async with open_stack(StackConfig(), engine=engine) as stack:
            ep = await run_episode(stack.rollout_context(env, get_harness("framework")), task)
        await close_workers()
        return ep

    ep = anyio.run(main)
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "replies"), [(1, ["I say river"]), (0, ["nope", "no", "still no", "x"])])
def test_parity_with_openenv_client(seed: int, replies: list[str]) -> None:
    """Our episode's reward equals OpenEnv's own client replaying the same actions on the same server."""
    from miles_env.adapters.venv import install
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack
    from tests.adapter_parity import framework_score

    install("openenv")
    env = load_environment(f"openenv:{GUESS}:app")
    task = {t.id: t for t in env.tasks()}[f"seed-{seed}"]
    tok = load_tokenizer("smollm2")

    async def main():  # type: ignore[no-untyped-def]
        engine = ScriptedEngine(tok, replies)
        async with open_stack(StackConfig(), engine=engine) as stack:
            ep = await run_episode(stack.rollout_context(env, get_harness("framework")), task)
        await close_workers()
        return ep, engine

    ep, engine = anyio.run(main)
    said = [tok.decode(g.output_ids, skip_special_tokens=True).strip() for g in engine.generations]
    field = ep.reward.details["action_field"]
    payload = {"root": str(GUESS.parent), "module": GUESS.stem, "attr": "app", "seed": seed}
    theirs = framework_score(
        "openenv", "openenv_client.py", {**payload, "actions": [{field: s} for s in said]}
    )
    assert ep.score == sum(theirs["rewards"]) == (1.0 if seed == 1 else 0.0)
    assert (
        ep.reward.details["steps"] == len(theirs["rewards"]) and ep.reward.details["done"] == theirs["done"]
    )
