"""CPU shims for megatron-core: the only place miles-env patches megatron or torch.cuda.

Concept: megatron-core 0.16 assumes CUDA in four spots that a CPU run reaches:
`torch.cuda.current_device()` (device placement of freshly created buffers, also the
pipeline's p2p receive buffers), `CudaRNGStatesTracker.fork()` (the model-parallel RNG
stream, which swaps CUDA RNG state) and the pipeline schedules' token counter
(`torch.zeros(..., device="cuda")` in `pipeline_parallel/schedules.py`). On a CPU-only
torch we make the first return the CPU device, the second a null context (our runs use
no dropout, so no RNG stream is consumed inside it), and give the schedules module a
`torch` whose `zeros` maps device "cuda" to the CPU (everything else is torch itself).
Fourth, with pipeline stages and tied embeddings, `LanguageModule.setup_embeddings_and_output_layer`
moves the last stage's copy of the embedding with `.cuda()` before all-reducing it over the
first and last stage: during that one method `Tensor.cuda` is the identity.
The p2p module gets the same `torch`, whose `cuda.synchronize()` is a no-op: exchanging
the shapes of variable-length microbatches calls it unconditionally; the tensors themselves
go over gloo's isend/irecv (`batch_p2p_comm=False`, set by the backend).

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
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.torch = p2p_communication.torch = _CudaToCpuTorch()  # type: ignore[attr-defined]
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def _setup_on_cpu(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign,assignment]
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = _setup_on_cpu  # type: ignore[method-assign]
    _APPLIED = True
    return True


class _NoSyncCuda:
    """`torch.cuda` whose `synchronize` is a no-op (nothing to wait for without a GPU)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _CudaToCpuTorch:
    """`torch` for megatron's schedules and p2p modules: `zeros(device="cuda")` lands on the CPU and
    `cuda.synchronize()` is a no-op; everything else is torch itself."""

    cuda = _NoSyncCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


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
