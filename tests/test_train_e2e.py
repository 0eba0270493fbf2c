"""`miles-env train` end to end on a tiny random Llama with the real SmolLM2 tokenizer.

Real parts throughout (hf engine, TITO proxy over HTTP, bubblewrap sandboxes, sqlite queue,
torch trainer); only the model is tiny so the loop runs in seconds. Includes the crash tests:
SIGKILL mid-run (and between two checkpoints, with leases held), restart from the run directory,
nothing lost and nothing trained twice. Every checkpoint is kept (trainer.keep_checkpoints), so the
lineage of the final model is the concatenation of their `trained_episode_ids`. The run's command line
and readers are tests/train_support.py, the tiny model the `tiny_model` fixture of conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_env.queue.sqlite import SqliteReplayQueue
from tests.train_support import rows, train_args, trained_ids


def _episode_states(run_dir: Path) -> dict[str, str]:
    """episode id -> the state of its group, read from queue.db with plain sqlite3."""
    with sqlite3.connect(run_dir / "queue.db") as db:
        cursor = db.execute("SELECT e.id, g.state FROM episodes e JOIN groups g ON g.group_id = e.group_id")
        return dict(cursor.fetchall())


@pytest.mark.slow
def test_train_runs_and_leaves_a_complete_run_dir(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(train_args(run_dir, tiny_model, 2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "reward_curve.png", "queue.db", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["episodes"] == 4 and r["samples"] >= 4
        assert r["staleness_mean"] == 0  # sync mode: every episode sampled with the latest weights
        assert r["logprob_diff_mean"] < 1e-4  # zero-KL check: trainer recomputes the engine's logprobs
        assert r["prefix_cache_requests"] >= 4 and r["prefix_cache_prompt_tokens"] > 0  # this step's turns
        assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    assert [r["step"] for r in rows(run_dir, "eval")] == [0, 2]
    stats = SqliteReplayQueue(run_dir / "queue.db").stats()
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8
    ids = trained_ids(run_dir)
    assert len(ids) == 8 and len(set(ids)) == 8
    # the weights moved and the engine served them: step-2 episodes were sampled at version 1
    versions = set()
    for journal in (run_dir / "sessions").glob("*.jsonl"):
        for line in journal.read_text().splitlines():
            event = json.loads(line)
            if "weight_version" in json.dumps(event):
                versions |= {t.get("weight_version") for t in _turns(event)}
    assert {0, 1} <= versions


@pytest.mark.slow
def test_checkpoint_every_acks_the_leases_taken_between_checkpoints(tmp_path: Path, tiny_model: Path) -> None:
    # Step 1 trains without a checkpoint; its leases must be acked with step 2's checkpoint, not
    # left leased (a 24 h lease would put them back into play in a long run).
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 2, "trainer.checkpoint_every=2", "eval.enabled=false")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))] == ["step_00000002"]
    stats = SqliteReplayQueue(run_dir / "queue.db").stats()
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8, stats
    assert not stats.episodes.get("leased"), stats
    assert len(set(trained_ids(run_dir))) == 8


@pytest.mark.slow
def test_fully_async_trains_through_the_same_loop(tmp_path: Path, tiny_model: Path) -> None:
    # Producers run beside the trainer (no in-line rollout phase), throttled by the queue.
    run_dir = tmp_path / "run"
    args = train_args(
        run_dir, tiny_model, 2, "mode=fully_async", "rollout.max_staleness=1", "eval.enabled=false"
    )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert "rollout_s" not in r and r["rollout_wait_s"] >= 0 and r["episodes"] == 4
        assert 0 <= r["staleness_mean"] <= 1 and r["logprob_diff_mean"] < 1e-4
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)) == 8
    states = _episode_states(run_dir)
    assert {eid for eid, state in states.items() if state == "acked"} == set(ids)
    assert "leased" not in states.values()


def _turns(event: dict) -> list[dict]:
    found: list[dict] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if "weight_version" in x:
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(event)
    return found


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_loses_nothing_and_trains_nothing_twice(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 4, "eval.enabled=false")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once step 2 is checkpointed (mid-run, step 3 under way)
        if len(list((run_dir / "checkpoints").glob("step_00000002"))) and proc.poll() is None:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the run never reached step 2")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = trained_ids(run_dir)
    assert len(before) >= 8

    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed at step" in out.stdout
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)) == 16  # 4 steps x 2 groups x 2 episodes, none twice
    assert ids[: len(before)] == before
    stats = SqliteReplayQueue(run_dir / "queue.db").stats()
    # every episode ever produced is in the queue: trained ones acked, the rest pending or stale
    assert stats.episodes.get("acked", 0) == 16
    assert stats.episodes.get("leased", 0) == 0
    assert [r["step"] for r in rows(run_dir, "train")][-2:] == [3, 4]


@pytest.mark.slow
def test_sigkill_between_checkpoints_then_resume_acks_each_trained_episode_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    # checkpoint_every=2: kill once step 3 is trained and reported, before step 4's checkpoint. Step 3's
    # groups are then trained but in no checkpoint: they must still be leased (not acked), go back to
    # the queue on restart and be trained again by the resumed model, exactly once in its lineage.
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 4, "trainer.checkpoint_every=2", "eval.enabled=false")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and 3 in [r["step"] for r in rows(run_dir, "train")]:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the run never reached step 3")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))] == ["step_00000002"]
    states = _episode_states(run_dir)
    in_checkpoint = set(trained_ids(run_dir))
    held = {eid for eid, state in states.items() if state == "leased"}
    assert len(in_checkpoint) == 8 and len(held) == 4  # steps 1-2 checkpointed; step 3 trained, held
    assert {eid for eid, state in states.items() if state == "acked"} == in_checkpoint

    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed at step 2" in out.stdout and "2 returned to the queue" in out.stdout, out.stdout
    lineage = trained_ids(run_dir)
    assert len(lineage) == len(set(lineage)) == 16, "an episode was trained twice"  # 4 steps x 2 x 2
    states = _episode_states(run_dir)
    acked = {eid for eid, state in states.items() if state == "acked"}
    assert acked == set(lineage), "acked and trained differ"  # each trained episode acked, nothing else
    assert held <= acked, "a group trained only by the killed process was lost"
    assert "leased" not in states.values()
    assert [r["step"] for r in rows(run_dir, "train")] == [1, 2, 3, 3, 4]


def _half_put(run_dir: Path) -> tuple[str, str]:
    """Leave one group that no checkpoint trained (pending, or leased by the killed step) as a kill
    between its two puts would: its second episode never stored, the group open and unleased.
    Returns (group id, the surviving episode id)."""
    trained = set(trained_ids(run_dir))
    with sqlite3.connect(run_dir / "queue.db") as db:
        groups = db.execute(
            "SELECT g.group_id, MIN(e.id), MAX(e.id) FROM groups g JOIN episodes e USING (group_id) "
            "WHERE g.state IN ('pending', 'leased') GROUP BY g.group_id ORDER BY g.group_id"
        ).fetchall()
        gid, keep, drop = next(g for g in groups if not {g[1], g[2]} & trained)
        db.execute("DELETE FROM episodes WHERE id=?", (drop,))
        db.execute("UPDATE episodes SET seq=1 WHERE id=?", (keep,))
        db.execute(
            "UPDATE groups SET n=1, state='open', completed_at=NULL, lease_id=NULL, lease_expires=NULL "
            "WHERE group_id=?",
            (gid,),
        )
    return gid, keep


def _produced_after_checkpoint(run_dir: Path) -> bool:
    """Step 2 is checkpointed and a group no checkpoint trained is put (pending or leased): not
    step 2's own groups, leased until their ack lands just after the checkpoint."""
    if not (run_dir / "checkpoints" / "step_00000002").is_dir():
        return False  # queue.db is read only then: its tables come ~20 ms after its file
    trained = set(trained_ids(run_dir))
    return any(s in ("pending", "leased") and e not in trained for e, s in _episode_states(run_dir).items())


@pytest.mark.slow
def test_sigkill_with_a_group_half_put_then_resume_completes_and_trains_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 6, "eval.enabled=false")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # kill once step 2 is checkpointed, step 3 put
        if _produced_after_checkpoint(run_dir):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the run never reached step 2 with a group put after it")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gid, kept = _half_put(run_dir)
    opened = [g.group_id for g in SqliteReplayQueue(run_dir / "queue.db").open_groups()]
    assert gid in opened  # with any the kill itself left half put
    before = trained_ids(run_dir)

    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"completed {len(opened)} groups the previous run left open" in out.stdout, out.stdout
    with sqlite3.connect(run_dir / "queue.db") as db:
        members = [r[0] for r in db.execute("SELECT id FROM episodes WHERE group_id=? ORDER BY seq", (gid,))]
        marks = "?" * len(opened)
        states = db.execute(
            f"SELECT state, n FROM groups WHERE group_id IN ({','.join(marks)})", opened
        ).fetchall()
    assert len(members) == 2 and members[0] == kept  # completed under its own group id
    assert states == [("acked", 2)] * len(opened)  # each completed and trained
    lineage = trained_ids(run_dir)
    assert len(lineage) == len(set(lineage)) == 24, "an episode was trained twice"  # 6 steps x 2 x 2
    assert lineage[: len(before)] == before and set(members) <= set(lineage)
    queue = SqliteReplayQueue(run_dir / "queue.db")
    assert queue.open_groups() == [] and queue.stats().episodes.get("leased", 0) == 0
    completed = [r.get("groups_completed_on_resume") for r in rows(run_dir, "train")]
    assert [c for c in completed if c is not None] == [float(len(opened))]


@pytest.mark.slow
def test_train_on_a_redis_queue(tmp_path: Path, tiny_model: Path) -> None:
    # `queue: {kind: redis}` through the real job: episodes go to redis-server (AOF on), none to
    # a queue.db; every trained group is acked there, and the checkpoints hold the same ids.
    from miles_env.queue.redis import RedisReplayQueue
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as server:
        sets = ("queue.kind=redis", f"queue.url={server.url}", "queue.prefix=e2e", "eval.enabled=false")
        proc = subprocess.run(
            train_args(run_dir, tiny_model, 2, *sets), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert not (run_dir / "queue.db").exists()
        queue = RedisReplayQueue(server.url, prefix="e2e", max_pending_groups=4)  # 2 x groups_per_step
        try:
            stats = queue.stats()
        finally:
            queue.close()
        cli = [sys.executable, "-m", "miles_env.cli.main", "queue", "stats", str(run_dir), "--json"]
        shown = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr  # the run's config.yaml names its Redis queue
        assert json.loads(shown.stdout) == json.loads(stats.model_dump_json())
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8, stats
    assert not stats.episodes.get("leased"), stats
    assert len(set(trained_ids(run_dir))) == 8
