"""A placed engine actor killed mid-run is replaced (miles_env/cluster/engine_faults.py).

Real parts: a local Ray cluster (a head of 0 CPUs and two nodes, each offering 2 CPUs,
{"rollout": 1} and {"engine": 1}), redis-server with AOF, `miles-env train` as a subprocess with
the hf engine over the tiny random Llama in each of two `EngineServer` actors, sglang-router in
front of them for the driver, a RolloutWorker per node on its own ring, the torch trainer.
The fault: once step 1 is checkpointed (the engines serve trained weights, not the base ones),
one engine actor's process is SIGKILLed. Checks: the run trains every step, each trained once;
cluster.json records the dead engine and its replacement `engine-2` on the freed engine node,
which joined at a trained weight version, serves the last step's version at the end and served
generations itself (the workers' rings got its URL); every step is zero-KL (the replacement
never sampled from stale weights). Also, without Ray: what a sync loaded is kept aside
(`keep_served`) so the trainer's next export cannot change what a replacement loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import train_support as e2e
from tests.cluster_support import actor_pids, queue_stats, train_argv, wait_for

# the replacement is placed, loads the current weights and joins while the survivor carries on:
# steps enough after the kill for the workers' sessions to reach it
STEPS = 64  # ~0.5-1 s each; the replacement joined 13-18 steps after the kill on 2 shared cores: 3x


@pytest.mark.slow
def test_a_killed_engine_actor_is_replaced_on_the_current_weights(
    tmp_path: Path, tiny_model: Path, engine_cluster: Any
) -> None:
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    engines = "cluster.engines={count: 2, resources: {engine: 1}, router: sglang-router}"
    log = tmp_path / "train.log"
    with RedisServer(tmp_path / "redis") as server, log.open("wb") as out:
        # the default staleness (1): an episode whose only turn hit the dead engine has no turn and
        # no weight version, so it does not make its group stale (queue/contract.py group_version)
        argv = train_argv(run_dir, tiny_model, STEPS, engine_cluster, server.url, engines, "engine.threads=1")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(proc, lambda: (run_dir / "checkpoints" / "step_00000001").exists(), "step 1", 300)
            pids = actor_pids(engine_cluster, "EngineServer")
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)  # the actor's process dies; its node lives on
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        stats = queue_stats(server.url)
    train = e2e.rows(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:  # every turn trained was sampled on the weights the trainer scored it with
        assert r["logprob_diff_mean"] < 1e-4, r
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * 4, trained
    assert stats.acked_groups == STEPS * 2 and not stats.episodes.get("leased"), stats
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert placed["engines_replaced"] == 1, placed
    lost = [e for e in placed["engines"] if not e["live"]]
    assert len(lost) == 1 and lost[0]["lost_error"], placed
    new = next(e for e in placed["engines"] if e["replaces"] is not None)
    assert new["name"] == "engine-2" and new["replaces"] == lost[0]["name"] and new["live"], placed
    assert new["node_id"] == lost[0]["node_id"]  # the only node with {"engine": 1} free again
    assert new["joined_version"] >= 1, new  # it loaded trained weights before joining
    assert new["weight_version"] == str(STEPS), new  # and got every sync after
    assert new["requests"] > 0, new  # the workers' sessions reached it
    survivor = next(e for e in placed["engines"] if e["live"] and e["replaces"] is None)
    assert survivor["weight_version"] == str(STEPS), placed
    assert actor_pids(engine_cluster, "EngineServer") == []  # every engine stopped at the end


def test_keep_served_holds_the_synced_export_when_the_next_one_replaces_it(tmp_path: Path) -> None:
    import shutil

    from miles_env.cluster.served import keep_served

    export = tmp_path / "weights"  # the trainer's export: rewritten whole at each step
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"step 1")
    (export / "config.json").write_text("{}")
    kept = keep_served(export)
    assert kept == tmp_path / "weights.served"
    assert (kept / "model.safetensors").stat().st_ino == (export / "model.safetensors").stat().st_ino
    shutil.rmtree(export)  # the next export (tmp dir, then rename) replaces the folder
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"step 2")
    assert (kept / "model.safetensors").read_bytes() == b"step 1"  # what the engines loaded at step 1
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.safetensors"]
    assert (keep_served(export) / "model.safetensors").read_bytes() == b"step 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights", "weights.served"]  # no leftovers
    single = tmp_path / "full.safetensors"  # a delta run's full sync is one file
    single.write_bytes(b"full")
    assert keep_served(single).read_bytes() == b"full"
