"""`miles-env train` with its rollouts on a Ray cluster (miles_env/cluster/), on one machine.

Real parts throughout: a local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and
two worker nodes, each offering one {"rollout": 1}), redis-server with AOF (tests/redis_server.py),
the hf engine over a tiny random Llama served by the driver through the embedded SGLang-compatible
server, one TITO proxy and bubblewrap sandboxes per worker, the torch trainer. Checks: the run
trains, every trained group is acked in Redis, both nodes rolled episodes out, each worker's
journal passes `tito audit`; and a node removed mid-run loses nothing and trains nothing twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from miles_env.config import load_config
from miles_env.errors import ConfigError
from tests import train_support as e2e  # tiny_model: the fixture of conftest.py
from tests.cluster_support import queue_stats, train_argv


def test_a_cluster_needs_the_shared_queue() -> None:
    with pytest.raises(ConfigError, match=r"queue\.kind: cluster\.address='auto' needs a shared queue"):
        load_config(None, ["cluster.address=auto"])
    assert load_config(None, ["cluster.address=auto", "queue.kind=redis"]).cluster.rollout_workers == 2
    assert load_config(None).cluster.address is None  # the default: one process


def _journal_episode_ids(store: Path) -> set[str]:
    """Episode ids of the sessions a proxy store journaled (run_episode names them on creation)."""
    ids = set()
    for journal in store.glob("*.jsonl"):
        for line in journal.read_text().splitlines():
            if '"episode_id"' in line:
                ids.add(json.loads(line)["metadata"]["episode_id"])
    return ids


def _audit(store: Path) -> subprocess.CompletedProcess[str]:
    cli = [sys.executable, "-m", "miles_env.cli.main", "tito", "audit", str(store)]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_workers_the_cluster_cannot_place_fail_the_run_with_what_they_need(
    tmp_path: Path, tiny_model: Path, ray_cluster: Any
) -> None:
    from tests.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        extra = ("cluster.worker_resources={tpu: 1}", "cluster.start_timeout_s=3")
        argv = train_argv(tmp_path / "run", tiny_model, 1, ray_cluster, server.url, *extra)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "error: cluster.rollout_workers=2: not all started within" in proc.stderr, proc.stderr[-2000:]
    assert "'tpu': 1.0" in proc.stderr


@pytest.mark.slow
def test_train_with_rollouts_on_two_ray_nodes(tmp_path: Path, tiny_model: Path, ray_cluster: Any) -> None:
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    rollout_nodes = {n.node_id for n in ray_cluster.worker_nodes}
    with RedisServer(tmp_path / "redis") as server:
        t0 = time.monotonic()
        proc = subprocess.run(
            train_argv(run_dir, tiny_model, 2, ray_cluster, server.url),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        stats = queue_stats(server.url)
    print(f"2-step cluster run: {time.monotonic() - t0:.1f}s")
    assert [r["step"] for r in e2e.rows(run_dir, "train")] == [1, 2]
    # each step's 2 groups went one to each worker, stamped with its node on the way through Redis
    assert all(r["episodes"] == 4 and r["rollout_nodes"] == 2 for r in e2e.rows(run_dir, "train"))
    assert stats.acked_groups == 4 and stats.episodes.get("acked") == 8, stats
    assert not stats.episodes.get("leased"), stats
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == 8 and len(set(trained)) == 8
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert {w["node_id"] for w in placed["workers"]} == rollout_nodes  # one worker on each rollout node
    assert all(w["groups"] >= 1 and w["alive"] for w in placed["workers"]), placed
    assert placed["workers_lost"] == 0 and placed["groups_redispatched"] == 0
    rolled = set()
    for w in placed["workers"]:  # every worker journals under RUN_DIR/sessions/<name>, drift-free
        store = run_dir / "sessions" / w["name"]
        audit = _audit(store)
        assert audit.returncode == 0 and "no drift" in audit.stdout, audit.stdout + audit.stderr
        rolled |= _journal_episode_ids(store)
    assert set(trained) <= rolled  # each trained episode was rolled out on a worker
    assert not _journal_episode_ids(run_dir / "sessions")  # and none by the driver's own proxy


@pytest.mark.slow
def test_fully_async_producers_dispatch_to_the_workers(
    tmp_path: Path, tiny_model: Path, ray_cluster: Any
) -> None:
    # the loop's producers (one per group slot per worker) dispatch; cancelled at the end, the calls
    # in flight are cancelled on the workers, which put nothing more
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as server:
        argv = train_argv(run_dir, tiny_model, 2, ray_cluster, server.url, "mode=fully_async")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        stats = queue_stats(server.url)
    assert [r["step"] for r in e2e.rows(run_dir, "train")] == [1, 2]
    assert stats.acked_groups == 4 and not stats.episodes.get("leased"), stats
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert sum(w["groups"] for w in placed["workers"]) >= 4 and placed["workers_lost"] == 0, placed


@pytest.mark.slow
def test_a_driver_killed_mid_run_resumes_on_the_cluster(
    tmp_path: Path, tiny_model: Path, ray_cluster: Any
) -> None:
    # SIGKILL of `miles-env train` (the driver): Ray reaps its workers (their owner died); the restart
    # from the same run directory recovers the Redis queue and dispatches to new workers
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as server:
        argv = train_argv(run_dir, tiny_model, 4, ray_cluster, server.url)
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step_00000002").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        before = e2e.trained_ids(run_dir)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        stats = queue_stats(server.url)
    assert "resumed at step" in out.stdout
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == 16  # 4 steps x 2 groups x 2 episodes, none twice
    assert trained[: len(before)] == before
    assert stats.episodes.get("acked") == 16 and not stats.episodes.get("leased"), stats
    assert [r["step"] for r in e2e.rows(run_dir, "train")][-2:] == [3, 4]


@pytest.mark.slow
def test_a_rollout_node_removed_mid_run_loses_nothing_and_trains_nothing_twice(
    tmp_path: Path,
    tiny_model: Path,
    ray_cluster: Any,
) -> None:
    """Last in the module: it takes a node from the module's cluster."""
    from tests.redis_server import RedisServer

    run_dir = tmp_path / "run"
    node = list(ray_cluster.worker_nodes)[-1]
    with RedisServer(tmp_path / "redis") as server:
        proc = subprocess.Popen(
            train_argv(run_dir, tiny_model, 3, ray_cluster, server.url),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            # once both workers have journaled a session (episodes in flight on each), lose one node
            deadline = time.monotonic() + 300
            while not all(any((run_dir / "sessions" / f"worker-{i}").glob("*.jsonl")) for i in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, "no rollouts on both workers"
                time.sleep(0.2)
            placed_before = time.monotonic()
            ray_cluster.remove_node(node)
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out[-4000:]
        stats = queue_stats(server.url)
    print(f"run finished {time.monotonic() - placed_before:.1f}s after the node was removed")
    assert [r["step"] for r in e2e.rows(run_dir, "train")] == [1, 2, 3]
    placed = json.loads((run_dir / "cluster.json").read_text())
    assert placed["workers_lost"] == 1 and placed["groups_redispatched"] >= 1, placed
    lost = next(w for w in placed["workers"] if not w["alive"])
    assert lost["node_id"] == node.node_id
    trained = e2e.trained_ids(run_dir)
    assert len(trained) == 12 and len(set(trained)) == 12  # 3 steps x 2 groups x 2: none twice
    assert stats.acked_groups == 6 and stats.episodes.get("acked") == 12, stats
    assert not stats.episodes.get("leased"), stats
    # a group the dead worker left short stays open, never trained; nothing else is lost
    assert stats.open_groups <= 1 and stats.episodes.get("open", 0) < 2, stats
    survivor = next(w for w in placed["workers"] if w["alive"])
    audit = _audit(run_dir / "sessions" / survivor["name"])
    assert audit.returncode == 0 and "no drift" in audit.stdout, audit.stdout
