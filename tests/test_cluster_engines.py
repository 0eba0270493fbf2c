"""Engines placed by Ray (`cluster.engines`, miles_env/cluster/engines.py), on one machine.

Real parts: a local Ray cluster (`ray.cluster_utils.Cluster`: a head of 0 CPUs and two nodes, each
offering 2 CPUs, {"rollout": 1} and {"engine": 1}), redis-server with AOF, `miles-env train` as a
subprocess with the hf engine over the tiny random Llama built inside each of two `EngineServer`
actors and served on its node over the SGLang native API, sglang-router in front of them for the
driver, a RolloutWorker per node reaching both engines on its own ring, the torch trainer.
Checks: one engine on each engine node, the run trains, every step's weight sync reached both
engines (`sync_engines`, `sync_s_engine{i}`) and each engine serves the last step's version at the
end; every trained group is acked once. (Real SGLang/vLLM on GPU nodes go through the same actor,
launching the server there: not run here, no GPU.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import train_support as e2e
from tests.cluster_support import queue_stats, train_argv


@pytest.mark.slow
def test_engines_placed_as_ray_actors_all_get_every_weight_sync(
    tmp_path: Path, tiny_model: Path, engine_cluster: Any
) -> None:
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    engines = "cluster.engines={count: 2, resources: {engine: 1}, router: sglang-router}"
    with RedisServer(tmp_path / "redis") as server:
        argv = train_argv(run_dir, tiny_model, 2, engine_cluster, server.url, engines, "engine.threads=1")
        log = tmp_path / "train.log"
        with log.open("wb") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        assert proc.returncode == 0, log.read_text()[-4000:]
        stats = queue_stats(server.url)
    nodes = {n.node_id for n in engine_cluster.worker_nodes}
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert [e["name"] for e in placed["engines"]] == ["engine-0", "engine-1"], placed
    assert {e["node_id"] for e in placed["engines"]} == nodes  # one engine on each engine node (SPREAD)
    assert all(e["live"] and e["weight_version"] == "2" for e in placed["engines"]), placed
    train = e2e.rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # the step's weights reached both engines, each timed
        assert r["sync_engines"] == 2 and r["sync_s_engine0"] > 0 and r["sync_s_engine1"] > 0, r
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8, stats
    assert not stats.episodes.get("leased"), stats
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == 8
    # the workers' turns came from the engine actors, on the weights of the step before
    assert all(w["groups"] >= 1 for w in placed["workers"]), placed
    assert train[1]["staleness_mean"] == 0, train[1]
