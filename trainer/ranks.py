"""One trainer over several processes (`torchrun ... miles-env train`): rank 0 leads, others follow.

Concept: under torchrun every rank runs `miles-env train`, but only rank 0 runs the job
(engine, sandboxes, proxy, queue, eval, logs). Every rank builds its trainer (the
megatron backend's collective set-up shards the model over tp x pp x dp; the torch backend's
FSDP2 shards it over every rank, trainer/fsdp.py); then rank 0's
trainer is wrapped in `Leader`, which broadcasts each collective call (its name and
pickled arguments, over the default process group) before making it, and every other
rank runs `follow(trainer)`, which receives each call and makes the same one.

Invariant: all ranks make the same trainer calls, in the same order, with the same
arguments (the batch included), which is what the backend's collectives need.
Lifecycle: `Leader.close()` broadcasts "stop", the followers return, and all ranks drop their
trainers and leave the process group together (`leave`: collect, barrier, destroy); if rank 0 dies,
torchrun stops the others. Between calls the followers wait in a broadcast, bounded by
the process group's timeout (torch's default: 30 minutes per rollout phase).
"""

from __future__ import annotations

import gc
import os
from typing import Any

__all__ = ["COLLECTIVE", "Leader", "follow", "leave", "torchrun_rank"]

# The trainer methods every rank must enter together (export_adapter: a sharded LoRA is gathered).
COLLECTIVE = frozenset(
    {
        "train_step",
        "state_dict",
        "export_weights",
        "export_adapter",
        "save_checkpoint",
        "load_checkpoint",
        "logprobs",
    }
)


def torchrun_rank() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _broadcast(message: tuple[str, tuple[Any, ...], dict[str, Any]] | None) -> Any:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's trainer: collective calls are announced to the followers first."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._trainer, name)
        if name not in COLLECTIVE:
            return attr

        def collective(*args: Any, **kwargs: Any) -> Any:
            _broadcast((name, args, kwargs))
            return attr(*args, **kwargs)

        return collective

    def close(self) -> None:
        _broadcast(("stop", (), {}))
        self._trainer = None
        leave()


def leave() -> None:
    """Free this rank's trainer state, then leave the process group together (barrier, destroy).

    A sharded model sits in reference cycles (FSDP2's module state), so only the garbage collector
    frees it, and with it the process group's backend it holds; left to interpreter exit, that
    teardown aborts a gloo rank now and then ("terminate called without an active exception",
    SIGABRT with no Python frame: 1 run in 40 of tests/fsdp_support.py's worker). So the caller
    drops its trainer first and this collects it while the interpreter is whole."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def follow(trainer: Any) -> int:
    """Repeat rank 0's trainer calls until it says stop; returns how many calls were made. The
    caller then drops `trainer` and calls `leave()`."""
    calls = 0
    while True:
        name, args, kwargs = _broadcast(None)
        if name == "stop":
            return calls
        if name not in COLLECTIVE:
            raise RuntimeError(f"rank 0 announced {name!r}, which is not a collective trainer call")
        getattr(trainer, name)(*args, **kwargs)
        calls += 1
