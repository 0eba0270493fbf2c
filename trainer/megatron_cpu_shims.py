"""CPU shims for megatron-core: the only place miles-env patches megatron or torch.cuda.

Concept: megatron-core 0.16 assumes CUDA in two spots that a CPU run reaches:
`torch.cuda.current_device()` (device placement of freshly created buffers) and
`CudaRNGStatesTracker.fork()` (the model-parallel RNG stream, which swaps CUDA RNG
state). On a CPU-only torch we make the first return the CPU device and the second
a null context (our runs use no dropout, so no RNG stream is consumed inside it).

Invariant: the shims apply only when CUDA is unavailable, are idempotent, and are
installed before any megatron model is built. On GPUs nothing is patched.

Lifecycle: `apply_cpu_shims()` once per process, then `init_distributed()`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import torch

__all__ = ["apply_cpu_shims", "init_distributed", "shims_active"]

_APPLIED = False


def shims_active() -> bool:
    return _APPLIED


def apply_cpu_shims() -> bool:
    """Patch the two CUDA assumptions on a CPU-only process; return True if patched (now or before)."""
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mrandom

    def _cpu_device() -> Any:
        return torch.device("cpu")

    def _no_fork(self: Any, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    mrandom.CudaRNGStatesTracker.fork = _no_fork  # type: ignore[method-assign,assignment]
    _APPLIED = True
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(tp: int = 1, pp: int = 1) -> None:
    """A process group (gloo on CPU, nccl on GPUs) and megatron's model-parallel groups.
    Outside torchrun this is a world of one on a free loopback port."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend)
        else:  # no env mutation: child processes must not inherit this process's rendezvous port
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(
                f"megatron parallel state already initialised with tp,pp={have}, asked {tp},{pp}"
            )
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
