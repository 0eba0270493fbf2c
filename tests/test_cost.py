"""Cost accounting (miles_env/cost.py): prices, an episode's Usage, step metrics and the run budget.

Real parts: the training loop (trainer/loop.py) with the tiny torch trainer and a SQLite queue for
the budget's stop semantics; the local (bubblewrap) provider with the scripted engine behind the
TITO proxy for an episode's Usage; `miles-env train` as a subprocess (scripted engine, tiny model)
for the cost metrics in metrics.jsonl and a budget that ends the run. Episode prices in the loop
tests are set by hand (a Usage per episode) so the step the budget is reached at is known.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import anyio
import pytest

from miles_env.cost import CostConfig, Price, RunCost, episode_usage
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.loop import LoopConfig, StepHooks, StepResult, TrainLoop
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Episode, Resources, Trajectory, Usage
from tests.train_support import rows, train_args
from tests.trainer_support import episode


def test_episode_price_by_provider_cpu_and_memory() -> None:
    res = Resources(memory_mb=2048, cpus=2.0)
    e2b = episode_usage([], 100.0, "e2b", res, CostConfig())
    assert e2b.price_usd == pytest.approx(100 * (2 * 0.000014 + 2 * 0.0000045))
    assert episode_usage([], 100.0, "local", res, CostConfig()).price_usd == 0.0
    mine = CostConfig(prices={"local": Price(per_s=0.01)})
    assert episode_usage([], 100.0, "local", res, mine).price_usd == pytest.approx(1.0)


class Spender(StepHooks):
    """The job's budget logic on hand-priced episodes: each group of 2 costs $0.30."""

    def __init__(self, queue: SqliteReplayQueue, trajs: tuple[Trajectory, Trajectory], budget: float) -> None:
        self.queue, self.trajs = queue, trajs
        self.cost = RunCost(CostConfig(budget_usd=budget))
        self.cursor = itertools.count()
        self.produced: list[str] = []
        self.started_when_exhausted = 0
        self.metrics: list[dict[str, float]] = []

    async def produce(self, n_groups: int) -> None:
        for _ in range(n_groups):
            if self.cost.exhausted:
                await anyio.sleep(0.01)
                return
            await anyio.sleep(0.05)  # the group "in flight"
            g = f"g{next(self.cursor)}"
            group = [self._priced(episode(f"{g}-{i}", g, self.trajs[i], s)) for i, s in enumerate((1.0, 0.0))]
            self.cost.add(group)
            for ep in group:  # past the budget the queue keeps it without waiting for capacity
                self.queue.put(ep, block=False) if self.cost.exhausted else await self.queue.aio.put(ep)
                self.produced.append(ep.id)

    @staticmethod
    def _priced(ep: Episode) -> Episode:
        return ep.model_copy(update={"usage": Usage(provider="fake", sandbox_s=1.0, price_usd=0.15)})

    def stop_reason(self) -> str | None:
        return self.cost.stop_reason()

    async def report(self, result: StepResult) -> None:
        self.metrics.append(self.cost.step_metrics(result.step, [e for g in result.groups for e in g]))


def test_budget_stops_a_sync_run_after_the_step_that_spends_it(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=4)
    hooks = Spender(q, trajs, budget=1.0)  # $0.60 a step: reached in step 2
    cfg = LoopConfig(steps=5, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", ckpt_every=3)
    loop = TrainLoop(q.aio, TorchTrainer(tiny, TrainerConfig(lr=1e-3)), cfg, hooks)
    assert anyio.run(loop.run) == 2
    assert loop.stopped is not None and "cost budget reached: $1.2000 spent" in loop.stopped
    assert [m["cost_usd_total"] for m in hooks.metrics] == pytest.approx([0.6, 1.2])
    assert [m["cost_per_step_usd"] for m in hooks.metrics] == pytest.approx([0.6, 0.6])
    assert hooks.metrics[1]["cost_per_solved_usd"] == pytest.approx(1.2 / 4)  # 4 passed episodes
    # step 2 is no checkpoint step (every 3): the stop checkpointed it and acked what it trained
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_00000002"]
    s = q.stats()
    assert s.acked_groups == 4 and s.leased_groups == 0 and s.pending_groups == 0


def test_budget_stops_a_fully_async_run_and_keeps_the_groups_in_flight(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=3)
    hooks = Spender(q, trajs, budget=1.0)  # reached by the 4th group ($1.20)
    cfg = LoopConfig(steps=10, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", producers=3, poll_s=0.01)
    loop = TrainLoop(q.aio, TorchTrainer(tiny, TrainerConfig(lr=1e-3)), cfg, hooks)
    step = anyio.run(loop.run)
    assert loop.stopped is not None and 0 < step < 10
    groups = len(hooks.produced) // 2
    assert 4 <= groups <= 6  # the 4th spends it; the other producers' groups in flight still finish
    s = q.stats()
    assert s.leased_groups == 0  # what was trained is acked, nothing is lost
    assert s.acked_groups + s.pending_groups == groups
    assert s.acked_groups == 2 * step or s.acked_groups == 2 * (step - 1) + 1  # a last, short step
    assert (tmp_path / "ckpt" / f"step_{step:08d}").is_dir()


def test_an_episode_on_the_local_provider_records_its_usage(tmp_path: Path) -> None:
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from tests.cli_harness_support import run_one, two_step_task

    replies = ["```sh\necho alpha > first.txt\n```", "```sh\necho alpha beta > second.txt\n```", "DONE"]
    engine = ScriptedEngine(load_tokenizer("smollm2"), replies)
    ep = anyio.run(lambda: run_one("builtin", engine, tmp_path / "store", two_step_task(), max_turns=3))
    assert ep.reward is not None and ep.reward.passed
    assert ep.usage is not None and ep.usage.provider == "local"
    assert 0 < ep.usage.sandbox_s <= ep.timings["total_s"] and ep.usage.price_usd == 0.0
    turns = [t for s in ep.samples for t in s.turns]
    assert len(turns) >= 2  # a second turn: it reuses the first one's prefix
    assert ep.usage.prompt_tokens == sum(t.prompt_len for t in turns)
    assert ep.usage.sampled_tokens == sum(s.n_sampled for s in ep.samples) > 0
    session = ep.metadata["session_id"]
    engine_cached = sum(c.generation.cached_tokens for c in engine.calls if c.session_id == session)
    assert ep.usage.cached_tokens == engine_cached > 0  # the engine's own prefix-cache hits


def test_the_fleet_shares_its_bucket_through_the_runs_redis_queue() -> None:
    from miles_env.config import validate_config
    from miles_env.errors import ConfigError
    from miles_env.stack import run_fleet

    cfg = validate_config(
        {"queue": {"kind": "redis", "url": "redis://h:1/0"}, "fleet": {"create_rate_per_s": 5}}
    )
    assert run_fleet(cfg).redis_url == "redis://h:1/0" and run_fleet(validate_config({})).redis_url is None
    with pytest.raises(ConfigError, match=r"fleet\.create_rate_per_s: Input should be greater than 0"):
        validate_config({"fleet": {"create_rate_per_s": 0}})
    with pytest.raises(ConfigError, match=r"cost\.budget_usd"):
        validate_config({"cost": {"budget_usd": -1}})


def _train(run_dir: Path, model: Path, steps: int, *extra: str) -> str:
    args = train_args(run_dir, model, steps, f"engine={{kind: scripted, model: {model}}}", *extra)
    log = run_dir.parent / "train.log"
    with log.open("w") as fh:  # a file, not an unread pipe
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_a_default_run_reports_cost_per_step(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, tiny_model, 2)
    evals = rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 2] and all(
        r["sandbox_s"] > 0 and r["cost_usd"] == 0.0 for r in evals
    )
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # the local provider is free: the price table's default
        assert r["cost_usd"] == 0.0 and r["cost_per_step_usd"] == 0.0 and r["sandbox_s"] > 0
        assert r["prompt_tokens"] > 0
    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    assert cost["total_usd"] == 0.0 and cost["sandbox_s"] >= sum(r["sandbox_s"] for r in train)


@pytest.mark.slow
def test_a_run_budget_ends_the_run_cleanly(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = _train(
        run_dir, tiny_model, 3, "eval.enabled=false", "cost.prices.local.per_s=1.0", "cost.budget_usd=0.001"
    )
    assert "stopped at step 1/3: cost budget reached" in out
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1] and train[0]["cost_usd_total"] > 0.001
    assert train[0]["cost_per_step_usd"] == train[0]["cost_usd_total"]
    assert (run_dir / "checkpoints" / "step_00000001").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["cost"]["total_usd"] == train[0]["cost_usd_total"]
    assert "cost: $" in out and "a step" in out
