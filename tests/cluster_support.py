"""Helpers of the cluster tests (tests/test_cluster*.py): the train command line and config of a
cluster run, the Redis queue's own counts, a local cluster with engine nodes, an actor class's
processes (to kill one), waiting on a running `miles-env train`. The rollout-only Ray cluster is
conftest.py's `ray_cluster` fixture.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests import train_support as e2e

__all__ = [
    "MB", "STEPS", "actor_pids", "cluster_config", "engine_nodes", "queue_stats", "train_argv", "train_cmd",
    "wait_for",
]  # fmt: skip

MB = 1024 * 1024
STEPS = 4


def train_argv(
    run_dir: Path, model: Path, steps: int, cluster: Any, redis_url: str, *extra: str
) -> list[str]:
    sets = [
        f"run_dir={run_dir}", f"engine.model={model}", f"trainer.steps={steps}", "rollout.group_size=2",
        "rollout.groups_per_step=2", "rollout.concurrency=4", "harness.max_tokens=8", "harness.max_turns=1",
        "trainer.lr=1e-3", "trainer.skip_zero_advantage=false", "trainer.keep_checkpoints=100",
        "eval.enabled=false", "queue.kind=redis", f"queue.url={redis_url}", "queue.prefix=cluster",
        f"cluster.address={cluster.address}", "cluster.rollout_workers=2", "cluster.worker_resources={rollout: 1}",
        *extra,
    ]  # fmt: skip
    out = [sys.executable, "-m", "miles_env.cli.main", "train", str(e2e.ROOT / "examples/terminal-cpu.yaml")]
    for s in sets:
        out += ["--set", s]
    return out


def queue_stats(url: str) -> Any:
    from miles_env.queue.redis import RedisReplayQueue

    queue = RedisReplayQueue(url, prefix="cluster", max_pending_groups=4)
    try:
        return queue.stats()
    finally:
        queue.close()


def cluster_config(tmp_path: Path, model: Path, cluster: Any, redis_url: str, steps: int = STEPS) -> Path:
    cfg = {
        "run_dir": str(tmp_path / "run"), "env": "terminal-basics", "eval": {"enabled": False},
        "engine": {"kind": "scripted", "model": str(model)},
        "harness": {"name": "builtin", "max_turns": 1, "max_tokens": 8},
        "rollout": {"group_size": 2, "groups_per_step": 2, "concurrency": 4, "tiers": [1]},
        "trainer": {"backend": "torch", "steps": steps, "lr": 1e-3, "skip_zero_advantage": False,
                    "keep_checkpoints": 100},
        "queue": {"kind": "redis", "url": redis_url, "prefix": "cluster"},
        "cluster": {"address": cluster.address, "rollout_workers": 2, "worker_resources": {"rollout": 1}},
    }  # fmt: skip
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_cmd(config: Path) -> list[str]:
    return [sys.executable, "-m", "miles_env.cli.main", "train", str(config)]


@contextmanager
def engine_nodes(count: int = 2) -> Iterator[Any]:
    """A local Ray cluster: a head of 0 CPUs and `count` nodes of 2 CPUs, {"rollout": 1}, {"engine": 1}."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * MB},
    )
    try:
        for _ in range(count):
            cluster.add_node(num_cpus=2, resources={"rollout": 1, "engine": 1}, object_store_memory=100 * MB)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def actor_pids(cluster: Any, actor_class: str) -> list[int]:
    """PIDs of this cluster's actor processes of `actor_class` (children of its raylets)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if not any(f"ray::{actor_class}" in part for part in p.info["cmdline"] or ()):
                continue
            parent = p.parent()
            if parent is not None and cluster.address in " ".join(parent.cmdline()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def wait_for(
    proc: subprocess.Popen[bytes], done: Callable[[], bool], what: str, timeout: float = 120.0
) -> None:
    """Poll `done` while `proc` (a running train) lives; fail if it ends first or after `timeout`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.05)
