"""What trains is what the policy did (INVARIANTS.md, "Episodes and faults").

Unit: a group's advantages are, bit for bit, those of the same group with its infrastructure
failures removed (the issue's own example: [1, 0, FAILED, ABORTED] trains [0.71, -0.71], not
[1.5, -0.5, -0.5, -0.5]); a policy end keeps its score; an episode stored before the classes
existed is classed by its status. Real stack (scripted engine, TITO proxy on loopback, local
sandboxes): each failure is classed where it is raised (a sandbox that never starts, a verifier
that raises or runs past its timeout, a sandbox lost mid-run, an engine that fails the turn, a
request the proxy refuses (whatever the harness took the 400 for), the agent's own timeout), and a group whose members failed is completed by rolling them out again, or
dropped once the attempts run out (`run_valid_group`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import anyio
import pytest

from miles_env.engines.base import Generation, SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.environment import Environment
from miles_env.errors import EngineError, SandboxError
from miles_env.faults import FaultyProvider
from miles_env.harness import HarnessResult
from miles_env.harnesses.builtin import BuiltinHarness
from miles_env.models import load_tokenizer
from miles_env.registry import load_environment
from miles_env.rollout import RolloutContext, run_episode, run_valid_group
from miles_env.sandbox import Sandbox
from miles_env.stack import StackConfig, open_stack
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.groups import TrainGroup
from miles_env.trainer.samples import flatten_groups
from miles_env.types import POLICY_ENDS, Episode, EpisodeEnd, Reward, Status, Task, Trajectory, Turn

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _traj(n: int, seed: int) -> Trajectory:
    ids = [1, 2, 3] + [10 + (seed * 7 + i) % 50 for i in range(n)]
    lps = [0.0] * 3 + [-0.1 * (1 + (seed + i) % 5) for i in range(n)]
    turn = Turn(start=3, prompt_len=3, completion_len=n, finish_reason="stop")
    return Trajectory(token_ids=ids, loss_mask=[0] * 3 + [1] * n, logprobs=lps, turns=[turn])


def _ep(i: int, score: float | None, status: Status, end: EpisodeEnd | None = None) -> Episode:
    reward = None if score is None else Reward(score=score)
    data: dict[str, Any] = {"id": f"e{i}", "task_id": "t", "env": "toy", "group_id": "g", "status": status,
                            "reward": reward, "samples": [_traj(4 + i, i)]}  # fmt: skip
    if end is not None:
        data["end"] = end
    return Episode.model_validate(data)


def _trained(samples: list[Any]) -> list[tuple[list[int], float]]:
    return [(list(s.token_ids), s.advantage) for s in samples]


def test_infrastructure_failures_leave_their_group_bit_for_bit() -> None:
    ok, zero = _ep(0, 1.0, Status.COMPLETED), _ep(1, 0.0, Status.COMPLETED)
    failed = _ep(2, None, Status.FAILED, EpisodeEnd.SANDBOX_START)
    aborted = _ep(3, None, Status.ABORTED, EpisodeEnd.ENGINE_ERROR)
    cfg = TrainerConfig()
    got = flatten_groups([[ok, zero, failed, aborted]], cfg)
    want = flatten_groups([[ok, zero]], cfg)
    assert _trained(got) == _trained(want)  # floats compared exactly: the same computation
    assert [round(s.advantage, 2) for s in got] == [0.71, -0.71]
    # what the old rule (every member, reward 0 when none) trained: the failures' tokens pushed down
    everyone = [ok, zero, _ep(2, 0.0, Status.COMPLETED), _ep(3, 0.0, Status.COMPLETED)]
    assert [round(s.advantage, 2) for s in flatten_groups([everyone], cfg)] == [1.5, -0.5, -0.5, -0.5]


def test_policy_ends_keep_their_score_and_the_config_says_which_they_are() -> None:
    timeout = _ep(2, 0.0, Status.TRUNCATED)  # the agent's own budget: a policy end, it trains
    group = [_ep(0, 1.0, Status.COMPLETED), timeout, _ep(3, None, Status.FAILED, EpisodeEnd.VERIFIER_ERROR)]
    assert timeout.end is EpisodeEnd.TRUNCATED and len(flatten_groups([group], TrainerConfig())) == 2
    wider = TrainerConfig(policy_ends=(*sorted(POLICY_ENDS), EpisodeEnd.VERIFIER_ERROR))
    assert len(flatten_groups([group], wider)) == 3  # a run may count more classes as the policy's
    # stored before the classes: failed and aborted said nothing of why, so they never train
    old = Episode.model_validate({**_ep(4, 0.0, Status.FAILED).model_dump(exclude={"end"})})
    assert old.end is EpisodeEnd.UNCLASSIFIED and not old.end.policy


def test_a_train_group_baseline_counts_rewards_that_never_train() -> None:
    ok, zero = _ep(0, 1.0, Status.COMPLETED), _ep(1, 0.0, Status.COMPLETED)
    stale = [_ep(5, 1.0, Status.COMPLETED), _ep(6, 1.0, Status.COMPLETED), _ep(7, None, Status.FAILED)]
    with_stale = flatten_groups([TrainGroup([ok, zero], baseline=stale)], TrainerConfig())
    alone = flatten_groups(
        [[ok, zero, _ep(5, 1.0, Status.COMPLETED), _ep(6, 1.0, Status.COMPLETED)]], TrainerConfig()
    )
    assert _trained(with_stale) == _trained(alone)[:2]  # same advantages; the stale ones never train
    # (and a stale infrastructure failure counts in no baseline either)


# -- classified where raised, on the real stack ---------------------------------------------------------


class _Env(Environment):
    """terminal-basics' first task; verify() raises, hangs or loses its sandbox when told to."""

    name = "faulty-basics"

    def __init__(self, verify: str = "ok") -> None:
        self.base = load_environment("terminal-basics")
        self.how = verify

    def tasks(self, split: str | None = None) -> list[Task]:
        return self.base.tasks(split)

    async def setup(self, task: Task, sandbox: Sandbox) -> None:
        await self.base.setup(task, sandbox)

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Any) -> Reward:
        if self.how == "raise":
            raise RuntimeError("the verifier has a bug")
        if self.how == "hang":
            await anyio.sleep(30)
        if self.how == "lost":
            raise SandboxError("sandbox vanished")
        return await self.base.verify(task, sandbox, transcript)


class _Engine(ScriptedEngine):
    """Answers DONE; `dead`: every turn fails (EngineError), `delay_s`: every turn is held."""

    dead = False

    async def generate(
        self, input_ids: Any, sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if self.dead:
            raise EngineError("engine died")
        return await super().generate(input_ids, sampling, session_id=session_id)


class _CrashingHarness(BuiltinHarness):
    async def run(self, task: Task, sandbox: Sandbox, endpoint: Any) -> Any:
        raise KeyError("the harness has a bug")


class _ImageHarness(BuiltinHarness):
    """Sends a content part the proxy refuses (an image) and, like the builtin harness, takes the
    400 for a budget: the proxy's record of the refusal says what it was."""

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Any) -> Any:
        import openai

        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            try:
                await c.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": [part]}]
                )
            except openai.BadRequestError as e:
                return HarnessResult(Status.TRUNCATED, [], f"budget: {e.message}")
        raise AssertionError("the proxy served an image part")


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("smollm2")


CASES: list[tuple[str, EpisodeEnd]] = [
    ("completed", EpisodeEnd.COMPLETED),
    ("sandbox", EpisodeEnd.SANDBOX_START),
    ("raise", EpisodeEnd.VERIFIER_ERROR),
    ("hang", EpisodeEnd.VERIFIER_TIMEOUT),
    ("lost", EpisodeEnd.SANDBOX_LOST),
    ("engine", EpisodeEnd.ENGINE_ERROR),
    ("harness", EpisodeEnd.HARNESS_CRASH),
    ("refused", EpisodeEnd.PROXY_REFUSAL),
    ("agent_timeout", EpisodeEnd.TRUNCATED),
]


async def test_each_failure_is_classed_where_it_is_raised(tok: Any) -> None:
    """One stack, one episode per case; a policy end trains beside a sibling, a failure does not."""
    engine = _Engine(tok, default_reply="DONE")
    async with open_stack(StackConfig(), engine=engine) as stack:
        for case, want in CASES:
            env = _Env(case if case in ("raise", "hang", "lost") else "ok")
            harness = {"harness": _CrashingHarness(), "refused": _ImageHarness()}.get(case, BuiltinHarness())
            ctx = stack.rollout_context(env, harness)
            if case == "sandbox":
                ctx = replace(ctx, provider=FaultyProvider(ctx.provider, rate=1.0))
            if case == "hang":
                ctx = replace(ctx, verifier_timeout_s=0.5)
            if case == "agent_timeout":
                ctx = replace(ctx, episode_timeout_s=0.3)
            engine.dead, engine.delay_s = case == "engine", 1.0 if case == "agent_timeout" else 0.0
            ep = await run_episode(ctx, env.tasks("train")[0])
            assert ep.end is want, (case, ep.status, ep.error)
            trains = bool(flatten_groups([[ep, _ep(9, 1.0, Status.COMPLETED)]], TrainerConfig()))
            assert ep.end.policy == (want in POLICY_ENDS) == trains, case


async def test_a_group_is_completed_by_rolling_its_failures_out_again(tok: Any) -> None:
    env = _Env()
    engine = _Engine(tok, default_reply="DONE")
    async with open_stack(StackConfig(), engine=engine) as stack:
        c = stack.rollout_context(env, BuiltinHarness())
        task = env.tasks("train")[0]
        flaky = FaultyProvider(c.provider, rate=0.5, seed=3)
        ctx = RolloutContext(env, c.harness, flaky, c.proxy, c.proxy_url)
        run = await run_valid_group(ctx, task, 4, policy_ends=POLICY_ENDS, attempts=5)
        assert not run.dropped and len(run.episodes) == 4 and all(e.end.policy for e in run.episodes)
        assert run.rerolled == len(run.replaced) == flaky.failed > 0  # counted: each failure rolled again
        assert all(e.end is EpisodeEnd.SANDBOX_START for e in run.replaced)
        assert len({e.group_id for e in run.rolled_out}) == 1
        never = RolloutContext(env, c.harness, FaultyProvider(c.provider, rate=1.0), c.proxy, c.proxy_url)
        gone = await run_valid_group(never, task, 2, policy_ends=POLICY_ENDS, min_valid=1, attempts=1)
        assert gone.dropped and gone.episodes == [] and len(gone.replaced) == 4 and gone.rerolled == 2


def test_end_rates_in_the_step_metrics() -> None:
    from miles_env.cli.eval import summarize
    from miles_env.evals.base import episode_stats

    eps = [_ep(0, 1.0, Status.COMPLETED), _ep(1, None, Status.FAILED, EpisodeEnd.SANDBOX_START)]
    stats = episode_stats(eps)
    assert stats["ends/completed"] == stats["ends/sandbox_start"] == 0.5 and stats["ends/engine_error"] == 0.0
    assert stats["pass_rate"] == 0.5 and stats["pass_rate_policy"] == 1.0
    assert set(itertools.chain(k for k in stats if k.startswith("ends/"))) == {
        f"ends/{e}" for e in EpisodeEnd
    }
    summary = summarize(eps)  # what `miles-env eval` prints
    assert summary["ends"] == {"completed": 1, "sandbox_start": 1} and summary["infra_failures"] == 1
    assert summary["pass_rate"] == 0.5 and summary["pass_rate_policy"] == 1.0


def test_the_loop_trains_a_lease_fresh_episodes_and_counts_stale_ones_only_as_told(tmp_path: Any) -> None:
    from miles_env.queue.contract import Lease
    from miles_env.trainer.loop import LoopConfig, TrainLoop

    fresh, stale = (
        (_ep(0, 1.0, Status.COMPLETED), _ep(1, 0.0, Status.COMPLETED)),
        (_ep(2, 1.0, Status.COMPLETED),),
    )
    lease = Lease("l", "g", fresh, 0.0, stale)
    for on in (False, True):
        loop = TrainLoop(
            None, None, LoopConfig(steps=1, groups_per_step=1, ckpt_dir=tmp_path, stale_in_baseline=on)
        )  # type: ignore[arg-type]
        group = loop._group(lease)
        assert list(group) == list(fresh) and lease.episode_ids == ["e0", "e1"]  # the stale one never trains
        assert isinstance(group, TrainGroup) == on and (not on or group.baseline == stale)
