"""The trainer placed by Ray (`cluster.trainer`, miles_env/cluster/trainer.py), on one machine.

Real parts: a local Ray cluster (a head of 0 CPUs, two rollout nodes offering {"rollout": 1} and a
trainer node offering {"trainer": 1}), redis-server with AOF, `miles-env train` as a subprocess
with the scripted engine and the torch trainer on the tiny model, built inside a `TrainerActor`
on the trainer node; the driver keeps the loop, the queue and the weight sync. Checks: the trainer
ran on the trainer node, every step trained and checkpointed through it, each trained episode
once; a restart resumes from its checkpoint on a new actor.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import train_support as e2e
from tests.cluster_support import MB, cluster_config, queue_stats, train_cmd


@pytest.fixture
def trainer_cluster() -> Iterator[tuple[Any, str]]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * MB},
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=100 * MB)
        trainer = cluster.add_node(num_cpus=1, resources={"trainer": 1}, object_store_memory=100 * MB)
        cluster.wait_for_nodes()
        yield cluster, trainer.node_id
    finally:
        cluster.shutdown()


def _run(argv: list[str], log: Path) -> None:
    with log.open("wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.mark.slow
def test_the_trainer_runs_as_a_ray_actor_on_the_trainer_node(
    tmp_path: Path, tiny_model: Path, trainer_cluster: tuple[Any, str]
) -> None:
    from tests.redis_server import RedisServer

    cluster, trainer_node = trainer_cluster
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as server:
        config = cluster_config(tmp_path, tiny_model, cluster, server.url, steps=2)
        placed = ["--set", "cluster.trainer={resources: {trainer: 1}}"]
        _run(train_cmd(config) + placed, tmp_path / "train.log")
        first = e2e.trained_ids(run_dir)
        _run(train_cmd(config) + placed + ["--set", "trainer.steps=3"], tmp_path / "resume.log")
        stats = queue_stats(server.url)
    assert json.loads((run_dir / "cluster_trainer.json").read_text())["node_id"] == trainer_node
    assert "resumed at step 2" in (tmp_path / "resume.log").read_text()
    train = e2e.rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["sync_bytes"] > 0 and "loss" in r for r in train), train  # metrics from the actor
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_00000001", "step_00000002", "step_00000003",
    ]  # fmt: skip
    trained = e2e.trained_ids(run_dir)
    assert trained[: len(first)] == first and len(trained) == len(set(trained)) == 12
    assert stats.acked_groups == 6 and not stats.episodes.get("leased"), stats
