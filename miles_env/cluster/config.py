"""The run config's `cluster` section: where the rollouts of `miles-env train` run.

Concept: with `address` unset (the default) the job runs in one process, exactly as without this
section. With `address` set ("auto", "host:port" of a Ray head, or "ray://host:port"), the
`miles-env train` process (the driver) joins that Ray cluster, keeps the trainer and the training
loop, and hands every group to one of `rollout_workers` Ray actors spread over the nodes
(miles_env/cluster/worker.py); the queue must then be shared (`queue.kind=redis`), which
`RunConfig` checks at load time. Invariant: pydantic and stdlib only (the run config composes it
without importing Ray).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClusterConfig"]


class ClusterConfig(BaseModel):
    """Ray placement of the rollout workers; `address: null` keeps everything in one process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = Field(
        None, description='Ray cluster to join: "auto", "host:port" or "ray://host:port"; null: one process'
    )
    rollout_workers: int = Field(2, ge=1, description="RolloutWorker actors, spread over the nodes")
    worker_cpus: float = Field(1.0, ge=0, description="logical CPUs each worker reserves")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description='custom Ray resources each worker needs, e.g. {"rollout": 1}'
    )
    engine_host: str | None = Field(
        None,
        description="address the driver serves an in-process engine on for the workers "
        "(default: this node's IP as Ray sees it)",
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="how long the workers may take to be placed and open their stacks"
    )
    max_attempts: int = Field(3, ge=1, description="workers a group is tried on before the run fails")
