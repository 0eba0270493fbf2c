"""Crash safety of train_from_queue: SIGKILL the trainer process mid-step or between checkpoint
and ack, restart it on the same run directory, and check that it resumes from the newest checkpoint
with no episode lost and none trained twice (in the lineage of the final model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.types import Episode, Reward, Status, Trajectory, Turn

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import anyio
    from miles_env.queue.sqlite import SqliteReplayQueue
    from miles_env.trainer.config import TrainerConfig
    from miles_env.trainer.loop import LoopConfig, train_from_queue
    from miles_env.trainer.torch_backend import TorchTrainer

    run, model, phase, kill_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    queue = SqliteReplayQueue(run / "queue.db")
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-3))
    log = open(run / "trained.jsonl", "a")

    def hang() -> None:  # failure injection: the parent SIGKILLs us while we sit here
        (run / "hanging").touch()
        time.sleep(120)

    load, step_fn, ack = trainer.load_checkpoint, trainer.train_step, queue.ack

    def load_checkpoint(d):
        extra = load(d)
        (run / "resumed_from").write_text(str(trainer.step))
        return extra

    def train_step(groups):
        step = trainer.step + 1
        log.write(json.dumps({"pid": os.getpid(), "step": step, "ids": [e.id for g in groups for e in g]}) + "\\n")
        log.flush()
        if phase == "step" and step == kill_at:
            hang()
        return step_fn(groups)

    def ack_fn(leases):
        if phase == "ack" and trainer.step == kill_at:
            hang()  # the checkpoint of this step is durable, the ack never happens
        ack(leases)

    trainer.load_checkpoint, trainer.train_step, queue.ack = load_checkpoint, train_step, ack_fn
    config = LoopConfig(steps=4, groups_per_step=2, ckpt_dir=run / "ckpt", ckpt_every=2)
    anyio.run(lambda: train_from_queue(queue.aio, trainer, config))
    """
)


def fill_queue(db: Path, n_groups: int) -> set[str]:
    q = SqliteReplayQueue(db, group_size=2)
    ids = set()
    for g in range(n_groups):
        for i in range(2):
            toks = [(7 * g + 3 * i + k) % 90 + 1 for k in range(10)]
            traj = Trajectory(
                token_ids=toks, loss_mask=[0] * 4 + [1] * 6, logprobs=[0.0] * 4 + [-2.0] * 6,
                turns=[Turn(start=4, prompt_len=4, completion_len=6, finish_reason="stop")],
            )  # fmt: skip
            ep = Episode(
                id=f"g{g}-e{i}", task_id=f"t{g}", env="toy", group_id=f"g{g}", status=Status.COMPLETED,
                reward=Reward(score=float(i)), samples=[traj],
            )  # fmt: skip
            q.put(ep, block=False)
            ids.add(ep.id)
    q.close()
    return ids


def run_child(script: Path, run: Path, model: Path, phase: str, kill_at: int) -> int:
    (run / "hanging").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(script), str(run), str(model), phase, str(kill_at)])
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (run / "hanging").exists():
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    return proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "kill_at", "resume_at"), [("step", 4, 2), ("ack", 2, 2)])
def test_sigkill_then_resume_trains_each_episode_once(
    tmp_path: Path, phase: str, kill_at: int, resume_at: int
) -> None:
    from tests.trainer_support import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    all_ids = fill_queue(run / "queue.db", 8)  # 8 groups = 4 steps x 2 groups
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    assert run_child(script, run, model, phase, kill_at) == -signal.SIGKILL
    assert run_child(script, run, model, "none", 0) == 0
    assert int((run / "resumed_from").read_text()) == resume_at

    records = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    first_pid = records[0]["pid"]
    # the final model descends from run 1 up to the checkpoint it resumed from, then from run 2
    lineage = [r for r in records if r["pid"] != first_pid or r["step"] <= resume_at]
    assert [r["step"] for r in lineage] == [1, 2, 3, 4]
    trained = [eid for r in lineage for eid in r["ids"]]
    assert len(trained) == len(set(trained)), "an episode was trained twice"
    assert set(trained) == all_ids, "an episode was lost"
    stats = SqliteReplayQueue(run / "queue.db").stats()
    assert stats.acked_groups == 8 and stats.leased_groups == 0 and stats.pending_groups == 0
