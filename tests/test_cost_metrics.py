"""Flag rates as step and eval metrics, and eval episodes' cost inside the run's budget.

Unit: `episode_stats` on episodes whose flags and guard notes are set by hand (every known flag
has its rate, `flags/zeroed` counts the rewards a flag set to 0); `RunCost.add_eval` (in the total
and the budget, never a solved task, kept across a checkpoint). End to end: `miles-env train` as
a subprocess (scripted engine whose policy tries `pip install` in every episode, the tiny model,
the real local sandboxes and guards), the local provider priced per second so the spend is known
to be positive: the flag rates in train and eval rows, eval cost in the next step's cost and the
summary, the viewer's flag filter, a budget the step-0 eval spends (no training starts), and a
resume whose restored spend is past the budget (the group the previous run left open is not
completed: it stays open).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from functools import partial
from pathlib import Path

import pytest

from miles_env.cost import CostConfig, RunCost
from miles_env.evals.base import episode_stats
from miles_env.guards import FLAGS, GuardsConfig, zero_flagged
from miles_env.queue.codec import decode_episode
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.types import Episode, Reward, Status, Usage
from miles_env.view import open_run
from tests.train_support import rows, train_args


def _ep(eid: str, flags: list[str], score: float = 1.0, price: float = 0.0, split: str = "train") -> Episode:
    reward = zero_flagged(Reward(score=score), tuple(flags), GuardsConfig(zero_reward_on=["test_edit"]))
    return Episode(
        id=eid, task_id="t", env="e", group_id="g", split=split, status=Status.COMPLETED, reward=reward,
        flags=flags, usage=Usage(provider="local", sandbox_s=2.0, price_usd=price),
    )  # fmt: skip


def test_flag_rates_cover_every_flag_and_count_zeroed_rewards() -> None:
    eps = [
        _ep("a", ["test_edit", "package_install"]),
        _ep("b", ["package_install"]),
        _ep("c", []),
        _ep("d", ["test_edit"], score=0.0),  # zeroed although it scored 0 anyway: a flag decided
    ]
    stats = episode_stats(eps)
    assert {k for k in stats if k.startswith("flags/")} == {f"flags/{f}" for f in FLAGS} | {"flags/zeroed"}
    assert stats["flags/test_edit"] == 0.5 and stats["flags/package_install"] == 0.5
    assert stats["flags/git_history"] == 0.0 and stats["flags/zeroed"] == 0.5
    assert stats["reward_mean"] == 0.5  # b and c kept their 1.0; a was zeroed by test_edit
    assert episode_stats(eps, "eval/")["eval/flags/zeroed"] == 0.5
    assert episode_stats([])["flags/test_edit"] == 0.0


def test_eval_cost_counts_toward_the_budget_but_solves_nothing() -> None:
    cost = RunCost(CostConfig(budget_usd=1.0))
    cost.add([_ep("t1", [], price=0.5)])
    cost.add_eval([_ep("e1", [], price=0.25, split="test"), _ep("e2", [], price=0.25, split="train")])
    cost.add_eval([_ep("e1", [], price=0.25)])  # counted once, by id
    assert cost.total_usd == 1.0 and cost.eval_usd == 0.5
    assert cost.solved == 1 and cost.exhausted  # the eval's passed train-split episode is no solved task
    metrics = cost.step_metrics(1, [])
    assert metrics["cost_usd"] == 1.0 and metrics["cost_eval_usd_total"] == 0.5
    assert "$0.5000 of it in evals" in cost.report_line(1)
    again = RunCost(CostConfig(budget_usd=1.0))
    again.restore(json.loads(json.dumps(cost.state())))  # as a checkpoint carries it
    assert again.eval_usd == 0.5 and again.exhausted
    assert cost.summary(1)["eval_usd"] == 0.5


def _policy(tmp: Path) -> Path:
    """Every episode tries to install a package first (a flag: package_install), then gives up."""
    path = tmp / "policy.json"
    path.write_text(json.dumps({"rules": [{"match": None, "replies": ["```sh\npip install requests\n```"]}]}))
    return path


def _train(run_dir: Path, model: Path, steps: int, *extra: str) -> str:
    engine = f"engine={{kind: scripted, model: {model}, script: {_policy(run_dir.parent)}}}"
    sets = ("harness.max_tokens=64", "cost.prices.local.per_s=0.001", *extra)
    args = train_args(run_dir, model, steps, engine, *sets)
    log = run_dir.parent / f"train-{len(list(run_dir.parent.glob('train-*.log')))}.log"
    with log.open("w") as fh:  # a file, not an unread pipe
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return " ".join(out.split())  # the console wraps long lines at its width


def _leave_a_group_open(run_dir: Path) -> str:
    """Put one episode of a new group of 2 (a copy of a trained one): what a killed job leaves."""
    with sqlite3.connect(run_dir / "queue.db") as db:
        meta, blob = db.execute("SELECT meta, arrays FROM episodes LIMIT 1").fetchone()
    ep = decode_episode(meta, blob)
    half = ep.model_copy(update={"id": "half-0", "group_id": f"{ep.task_id}:half"})
    queue = SqliteReplayQueue(run_dir / "queue.db")
    queue.put(half, block=False)
    assert [g.group_id for g in queue.open_groups()] == [half.group_id]
    queue.close()
    return half.group_id


@pytest.mark.slow
def test_a_run_logs_flag_rates_and_counts_its_evals_cost(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = _train(run_dir, tiny_model, 1, "guards.zero_reward_on=[package_install]")
    (train,) = rows(run_dir, "train")
    evals = rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 1]
    for r in [train, *evals]:  # every episode tried pip: flagged, and its reward zeroed
        assert r["flags/package_install"] == 1.0 and r["flags/zeroed"] == 1.0, r
        assert r["flags/test_edit"] == 0.0 and r["flags/git_history"] == 0.0
    assert all(r["cost_usd"] > 0 for r in evals)
    # the step-0 eval was spent before step 1's report: it is in that step's cost and eval total
    assert train["cost_eval_usd_total"] == pytest.approx(evals[0]["cost_usd"])
    assert train["cost_usd"] == pytest.approx(train["cost_usd_total"])
    assert train["cost_usd"] > evals[0]["cost_usd"]
    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    assert cost["eval_usd"] == pytest.approx(sum(r["cost_usd"] for r in evals))
    assert cost["total_usd"] > cost["eval_usd"]
    assert "step 1/1" in out and f"(total ${train['cost_usd_total']:.4f})" in out
    assert f"${cost['eval_usd']:.4f} of it in evals" in out
    # the viewer's episode table filters by flag: every episode, train and eval, raised this one
    index = open_run(run_dir, None, preload=False).index
    page = partial(index.page, offset=0, limit=500, sort="", desc=False)
    everyone = page(filters={}).total
    assert everyone >= 4 + 2 and page(filters={"flag": "package_install"}).total == everyone
    assert page(filters={"flag": "any"}).total == everyone and page(filters={"flag": "none"}).total == 0
    assert page(filters={"flag": "test_edit"}).total == 0 and index.facets()["flag"] == ["package_install"]

    # resumed with a budget its restored spend is past: the open group stays open, nothing runs
    gid = _leave_a_group_open(run_dir)
    out = _train(run_dir, tiny_model, 2, "cost.budget_usd=0.000001")
    assert "left open" not in out and "stopped at step 1/2: cost budget reached" in out, out[-3000:]
    assert [g.group_id for g in SqliteReplayQueue(run_dir / "queue.db").open_groups()] == [gid]
    assert len(rows(run_dir, "train")) == 1


@pytest.mark.slow
def test_a_budget_the_first_eval_spends_starts_no_training(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = _train(run_dir, tiny_model, 2, "cost.budget_usd=0.000001")
    (before,) = rows(run_dir, "eval")  # no final eval either: the budget is spent
    assert before["step"] == 0 and before["cost_usd"] > 0.000001
    assert rows(run_dir, "train") == [] and "stopped at step 0/2: cost budget reached" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["cost"]["total_usd"] == pytest.approx(before["cost_usd"])
    assert summary["cost"]["eval_usd"] == pytest.approx(before["cost_usd"])
