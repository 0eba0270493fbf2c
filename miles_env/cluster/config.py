"""The run config's `cluster` section: where the rollouts (and the engines) of `miles-env train` run.

Concept: with `address` unset (the default) the job runs in one process, exactly as without this
section. With `address` set ("auto", "host:port" of a Ray head, or "ray://host:port"), the
`miles-env train` process (the driver) joins that Ray cluster, keeps the trainer and the training
loop, and hands every group to one of `rollout_workers` Ray actors spread over the nodes
(miles_env/cluster/worker.py); the queue must then be shared (`queue.kind=redis`), which
`RunConfig` checks at load time. A worker that dies is replaced (`replace_workers`). With
`engines` set, the run's engine is not built in the driver: `engines.count` Ray actors
(cluster/engines.py) each build it on an engine node and serve it over the SGLang native API, and
the driver and the workers are clients of all of them; one that dies is replaced
(`engines.replace`). With `trainer` set, the trainer too runs as an actor (cluster/trainer.py)
and the driver only orchestrates. Invariant: pydantic and stdlib only (the run config composes it
without importing Ray).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClusterConfig", "EnginesConfig", "TrainerPlacement"]


class EnginesConfig(BaseModel):
    """Engines placed by Ray: `count` actors, each building `engine` and serving it on its node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(1, ge=1, description="engine actors (one engine server each)")
    cpus: float = Field(1.0, ge=0, description="logical CPUs each engine actor reserves")
    gpus: float = Field(0.0, ge=0, description="GPUs each engine actor reserves (SGLang/vLLM launched on it)")
    resources: dict[str, float] = Field(
        default_factory=dict, description='custom Ray resources each engine needs, e.g. {"engine": 1}'
    )
    router: Literal["ring", "sglang-router"] = Field(
        "ring", description="the driver's client: its own hash ring over the engines, or sglang-router"
    )
    replace: bool = Field(
        True,
        description="start a new engine actor for each one that dies; it joins every ring once it "
        "serves the current weight version (cluster/engine_faults.py)",
    )


class TrainerPlacement(BaseModel):
    """The trainer as a Ray actor (cluster/trainer.py): where it runs and what it reserves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: float = Field(1.0, ge=0, description="logical CPUs the trainer actor reserves")
    gpus: float = Field(0.0, ge=0, description="GPUs the trainer actor reserves")
    resources: dict[str, float] = Field(
        default_factory=dict, description='custom Ray resources it needs, e.g. {"trainer": 1}'
    )


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
    replace_workers: bool = Field(
        True, description="start a new worker (where Ray finds room) for each one that dies"
    )
    engines: EnginesConfig | None = Field(
        None,
        description="engines placed by Ray as actors (null: the driver's own engine, or engine.url/urls)",
    )
    trainer: TrainerPlacement | None = Field(
        None, description="the trainer as a Ray actor on a trainer node (null: in the driver)"
    )
