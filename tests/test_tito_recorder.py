"""TitoProxy is the rollout's SessionRecorder (miles_env/harness.py): the contract holds at runtime and
for mypy, `context_limit` is the limit `chat` enforces, and a real episode through the stack gets it
on its Endpoint and leaves a journal `miles-env tito audit` passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from miles_env.engines.base import EngineInfo
from miles_env.engines.scripted import ScriptedEngine
from miles_env.harness import Endpoint, HarnessResult, SessionRecorder
from miles_env.models import load_tokenizer
from miles_env.registry import load_environment
from miles_env.rollout import run_episode
from miles_env.sandbox import Sandbox
from miles_env.stack import StackConfig, open_stack
from miles_env.tito import Budget, TitoConfig, TitoProxy
from miles_env.types import Status, Task

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Mute(ScriptedEngine):
    """An engine that cannot describe itself (a server still starting)."""

    async def info(self) -> EngineInfo:
        raise ConnectionError("engine not up yet")


def test_tito_proxy_is_a_session_recorder(tok: Any) -> None:
    proxy = TitoProxy(ScriptedEngine(tok), tok)
    recorder: SessionRecorder = proxy  # mypy checks every signature here
    assert isinstance(recorder, SessionRecorder)
    assert not isinstance(object(), SessionRecorder)


@pytest.mark.parametrize(
    ("engine_limit", "budget", "want"),  # engine_limit None: an engine that cannot describe itself
    [(8192, None, 8192), (8192, 1000, 1000), (500, 1000, 500), (None, 1000, 1000), (None, None, None)],
)
async def test_context_limit_is_the_min_of_budget_and_engine(
    tok: Any, engine_limit: int | None, budget: int | None, want: int | None
) -> None:
    engine = ScriptedEngine(tok, max_context=engine_limit) if engine_limit else _Mute(tok)
    proxy = TitoProxy(engine, tok, TitoConfig(budget=Budget(max_context=budget)))
    sid = proxy.create_session().session_id
    assert await proxy.context_limit(sid) == want


class _OneCall:
    """A harness that asks the model once through its Endpoint and keeps what it was handed."""

    name = "one-call"

    def __init__(self) -> None:
        self.endpoints: list[Endpoint] = []

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        self.endpoints.append(endpoint)
        body = {"model": endpoint.model, "messages": [{"role": "user", "content": task.instruction}]}
        headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{endpoint.base_url}/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        return HarnessResult(Status.COMPLETED, [{"role": "assistant", "content": "done"}])


async def test_an_episode_gets_the_limit_and_leaves_an_auditable_journal(tok: Any, tmp_path: Path) -> None:
    env = load_environment("terminal-basics")
    task = env.tasks()[0]
    engine = ScriptedEngine(tok, ["I am done."], max_context=3000)
    harness = _OneCall()
    cfg = StackConfig(tito=TitoConfig(budget=Budget(max_context=2048)), store_dir=tmp_path / "sessions")
    async with open_stack(cfg, engine=engine) as stack:
        ep = await run_episode(stack.rollout_context(env, harness), task)
    (endpoint,) = harness.endpoints
    assert endpoint.max_context == 2048 and endpoint.session_id == ep.metadata["session_id"]
    assert (ep.status, ep.harness, len(ep.samples)) == (Status.COMPLETED, "one-call", 1), ep.error
    assert [t for t, m in zip(ep.samples[0].token_ids, ep.samples[0].loss_mask, strict=True) if m] == list(
        engine.generations[0].output_ids
    )
    journal = (tmp_path / "sessions" / f"{endpoint.session_id}.jsonl").read_text()
    assert [line.split('"', 4)[3] for line in journal.splitlines()] == ["session", "turn", "closed"]
    cli = [sys.executable, "-m", "miles_env.cli.main", "tito", "audit", str(tmp_path)]
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(cli, capture_output=True, text=True, timeout=120)
    )
    assert done.returncode == 0 and "no drift" in done.stdout, done.stdout + done.stderr
