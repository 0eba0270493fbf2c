"""`ray job submit -- miles-env train CONFIG --set cluster.address=auto` against a local Ray cluster.

Real parts: a local multi-node Ray cluster whose head runs the dashboard (Ray's job server, the
`ray[default]` extra) on a free loopback port and two worker nodes offering {"rollout": 1},
redis-server with AOF, the `ray` CLI submitting `miles-env train` (the scripted engine, the torch
trainer on the tiny model) as a Ray job: the entrypoint runs on the head node, joins the cluster
with `cluster.address=auto` (the job's RAY_ADDRESS), and its rollout workers are placed on the two
rollout nodes. The exact commands are those of docs/scaling.md ("Submitting a run as a Ray job").
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_env.http import free_port
from tests import train_support as e2e
from tests.cluster_support import MB, cluster_config, queue_stats


@pytest.fixture
def dashboard_cluster() -> Iterator[tuple[Any, str]]:
    from ray.cluster_utils import Cluster

    port = free_port()
    head = {"num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
            "object_store_memory": 100 * MB}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=100 * MB)
        cluster.wait_for_nodes()
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_ray_job_submit_runs_the_training_on_the_cluster(
    tmp_path: Path, tiny_model: Path, dashboard_cluster: tuple[Any, str]
) -> None:
    from tests.redis_server import RedisServer

    cluster, dashboard = dashboard_cluster
    run_dir = tmp_path / "run"
    ray_cli = str(Path(sys.executable).parent / "ray")
    with RedisServer(tmp_path / "redis") as server:
        config = cluster_config(tmp_path, tiny_model, cluster, server.url, steps=2)
        train = (
            f"{shlex.quote(sys.executable)} -m miles_env.cli.main train {config} --set cluster.address=auto"
        )
        env_vars = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        argv = [ray_cli, "job", "submit", "--address", dashboard, "--runtime-env-json",
                json.dumps({"env_vars": env_vars}), "--", *shlex.split(train)]  # fmt: skip
        log = tmp_path / "submit.log"
        with log.open("wb") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=300)
        text = log.read_text(errors="replace")
        assert proc.returncode == 0, text[-4000:]
        stats = queue_stats(server.url)
    assert "succeeded" in text and "done 2 steps" in text, text[-3000:]  # the job's own output, tailed
    assert [r["step"] for r in e2e.rows(run_dir, "train")] == [1, 2]
    assert all(r["rollout_nodes"] == 2 for r in e2e.rows(run_dir, "train"))
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8, stats
    assert not stats.episodes.get("leased"), stats
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == 8
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert {w["node_id"] for w in placed["workers"]} == {n.node_id for n in cluster.worker_nodes}
