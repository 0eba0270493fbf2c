"""The trainer placed by Ray: `cluster.trainer` runs the run's trainer as an actor on a trainer node.

Concept: `TrainerActor` builds the trainer (`trainer.backend`, torch by default) where Ray places
it (`cluster.trainer.resources`, e.g. {"trainer": 1}, and its CPUs/GPUs); `RemoteTrainer` is the
driver's `TrainerBackend` over it, so the loop, the queue, the checkpoints' bookkeeping and the
weight sync stay in the driver, which only orchestrates. Each call is one actor call (groups in,
metrics out; the loop already runs `train_step` in a worker thread, so a blocking `ray.get` there
holds nothing up). Checkpoints and exported weights are paths under the run directory, which must
be on storage the trainer node and the driver share; `state_dict` (in-process or delta weight sync)
copies the weights to the driver through Ray's object store. `named_parameters` answers with
shape-only tensors (one element each, expanded), enough for the job's byte count, never the data.

Invariant: `step` is the actor's, read back after every call that can change it.
Lifecycle: `remote_trainer(cfg, model_path, options)` joins the cluster, blocks until the trainer
is built and records its node in RUN_DIR/cluster_trainer.json; the actor dies with the driver
(Ray reaps an owner's actors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_env.cluster import session
from miles_env.config import RunConfig
from miles_env.errors import ClusterError
from miles_env.jsonio import write_json
from miles_env.types import Episode

if TYPE_CHECKING:
    import torch

__all__ = ["TrainerActor", "RemoteTrainer", "remote_trainer"]

Shape = tuple[str, tuple[int, ...], str]  # (name, shape, dtype name) of one distinct parameter


class TrainerActor:
    """The actor's class (wrapped with `ray.remote` by `remote_trainer`)."""

    def __init__(self, backend: str, model_path: str, options: Mapping[str, Any]) -> None:
        from miles_env.trainer.build import build_trainer

        self.trainer = build_trainer(backend, Path(model_path), options)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), self.trainer.step

    def call(self, name: str, *args: Any) -> tuple[Any, int]:
        """One TrainerBackend method; returns its result and the step after it."""
        return getattr(self.trainer, name)(*args), self.trainer.step

    def shapes(self) -> list[Shape]:
        seen: set[int] = set()
        out = []
        for name, p in self.trainer.named_parameters():
            if p.data_ptr() not in seen:  # tied weights once
                seen.add(p.data_ptr())
                out.append((name, tuple(p.shape), str(p.dtype).removeprefix("torch.")))
        return out


class RemoteTrainer:
    """The driver's TrainerBackend over a `TrainerActor` (module docstring)."""

    def __init__(self, actor: Any, node_id: str, step: int) -> None:
        self.actor = actor
        self.node_id = node_id
        self.step = step
        self._shapes: list[Shape] | None = None

    def _call(self, name: str, *args: Any) -> Any:
        import ray

        out, self.step = ray.get(self.actor.call.remote(name, *args))
        return out

    def train_step(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
        result: dict[str, float] = self._call("train_step", [list(g) for g in groups])
        return result

    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
        return Path(self._call("save_checkpoint", str(ckpt_dir), extra))

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self._call("load_checkpoint", str(ckpt_dir))
        return result

    def state_dict(self) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = self._call("state_dict")
        return result

    def export_weights(self, path: str | Path) -> Path:
        return Path(self._call("export_weights", str(path)))

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        import ray
        import torch

        if self._shapes is None:
            self._shapes = ray.get(self.actor.shapes.remote())
        for name, shape, dtype in self._shapes:
            one = torch.empty(1, dtype=getattr(torch, dtype)).expand(shape)
            yield name, torch.nn.Parameter(one, requires_grad=False)


def remote_trainer(cfg: RunConfig, model_path: Path, options: Mapping[str, Any]) -> RemoteTrainer:
    """Join the cluster, place the trainer actor, wait until it has built the trainer."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    c = cfg.cluster
    assert c.address is not None and c.trainer is not None
    session.join(c.address)
    t = c.trainer
    actor_cls = ray.remote(TrainerActor).options(
        num_cpus=t.cpus, num_gpus=t.gpus, resources=dict(t.resources), max_restarts=0,
        max_task_retries=0, max_concurrency=1,
    )  # fmt: skip
    actor: Any = actor_cls.remote(cfg.trainer.backend, str(model_path), dict(options))
    try:
        node_id, step = ray.get(actor.where.remote(), timeout=c.start_timeout_s)
    except (GetTimeoutError, RayActorError) as e:
        ray.kill(actor, no_restart=True)
        need = {"CPU": t.cpus, "GPU": t.gpus, **t.resources}
        raise ClusterError(
            f"cluster.trainer: not started within cluster.start_timeout_s={c.start_timeout_s:g} "
            f"(does the cluster offer {need}?): {str(e).splitlines()[0][:300]}"
        ) from None
    write_json(cfg.run_dir / "cluster_trainer.json", {"node_id": node_id, "step": step})
    return RemoteTrainer(actor, node_id, step)
