"""CPU shims for megatron-core: the only place miles-env patches megatron or torch.cuda.

Concept: megatron-core 0.16 assumes CUDA in four spots that a CPU run reaches:
`torch.cuda.current_device()` (device placement of freshly created buffers, also the
pipeline's p2p receive buffers), `CudaRNGStatesTracker.fork()` (the model-parallel RNG
stream, which swaps CUDA RNG state) and the pipeline schedules' token counter
(`torch.zeros(..., device="cuda")` in `pipeline_parallel/schedules.py`). On a CPU-only
torch we make the first return the CPU device, the second a null context (our runs use
no dropout, so no RNG stream is consumed inside it), and give the schedules module a
`torch` whose `zeros` / `tensor` / `empty` map device "cuda" to the CPU (the rest is torch).
Fourth, with pipeline stages and tied embeddings, `LanguageModule.setup_embeddings_and_output_layer`
moves the last stage's copy of the embedding with `.cuda()` before all-reducing it over the
first and last stage: during that one method `Tensor.cuda` is the identity.
The p2p module gets the same `torch`, whose `cuda.synchronize()` is a no-op: exchanging
the shapes of variable-length microbatches calls it unconditionally; the tensors themselves
go over gloo's isend/irecv (`batch_p2p_comm=False`, set by the backend).

For megatron's DistributedOptimizer (`apply_optimizer_shims`, only when it is asked for): its
modules (optimizer, distrib_optimizer, clip_grads, param_and_grad_buffer, finalize_model_grads,
and utils' local multi-tensor l2 norm) get the same CPU `torch`, and the two spots that dispatch
on `Tensor.type()` strings ('torch.cuda.FloatTensor', else TypeError) see CPU tensors named as
CUDA ones while they run. gloo itself has every collective needed (reduce_scatter_tensor and
all_gather_into_tensor work on torch 2.13).

MoE without TransformerEngine (CPU or GPU): the router's gating tests a name, `te_general_gemm`,
that megatron defines only when TE imports; it is set to None, the torch.mm fallback it means.
The MoE layers run SequentialMLP experts and the all-gather token dispatcher (the all-to-all one
creates CUDA streams), which need nothing more on CPU.

Invariant: the shims apply only when CUDA is unavailable (but for that missing name), are
idempotent, and are installed before any megatron model is built. On GPUs nothing else is patched.

Lifecycle: `apply_cpu_shims()` once per process, then `init_distributed()`;
`apply_optimizer_shims()` before building a DistributedOptimizer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from typing import Any

import torch

__all__ = ["apply_cpu_shims", "apply_optimizer_shims", "init_distributed", "shims_active"]

_APPLIED = False
_OPT_APPLIED = False


def shims_active() -> bool:
    return _APPLIED


def apply_cpu_shims() -> bool:
    """Patch the two CUDA assumptions on a CPU-only process; return True if patched (now or before)."""
    global _APPLIED
    _no_te_router_gemm()  # CPU or GPU: megatron without TransformerEngine, not a CUDA assumption
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


def _no_te_router_gemm() -> None:
    """megatron-core 0.16's MoE router gating names `te_general_gemm` only when TransformerEngine
    imports, then tests it for None: without TE the name is missing (a NameError at the first MoE
    forward). Define it as None, the fallback it means (torch.mm)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


class _NoSyncCuda:
    """`torch.cuda` whose `synchronize` is a no-op (nothing to wait for without a GPU)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


def _on_cpu(make: Any) -> Any:
    def create(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return make(*args, device="cpu" if device == "cuda" else device, **kwargs)  # type: ignore[no-any-return]

    return staticmethod(create)


class _CudaToCpuTorch:
    """`torch` for megatron modules that hard-code CUDA: `zeros` / `tensor` / `empty` with
    device="cuda" land on the CPU and `cuda.synchronize()` is a no-op; the rest is torch itself."""

    cuda = _NoSyncCuda()
    zeros, tensor, empty = _on_cpu(torch.zeros), _on_cpu(torch.tensor), _on_cpu(torch.empty)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CUDA_TYPE_NAMES = {f"torch.{k}Tensor": f"torch.cuda.{k}Tensor" for k in ("Float", "Half", "BFloat16")}


def _cuda_type_names(fn: Any) -> Any:
    """`fn` run while `Tensor.type()` (no arguments) names CPU float tensors as CUDA ones: megatron's
    optimizers dispatch on those strings ('torch.cuda.FloatTensor') and refuse anything else."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.type

        def type_name(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = original(t, *a, **k)
            return _CUDA_TYPE_NAMES.get(name, name) if not a and not k else name  # type: ignore[call-overload]

        torch.Tensor.type = type_name  # type: ignore[method-assign,assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original  # type: ignore[method-assign]

    return wrapper


def apply_optimizer_shims() -> None:
    """For megatron's DistributedOptimizer on CPU: the CUDA-hard-coding modules get the CPU `torch`,
    the two places that dispatch on tensor type names get CPU tensors named as CUDA ones."""
    global _OPT_APPLIED
    if not _APPLIED or _OPT_APPLIED:
        return
    _OPT_APPLIED = True
    from megatron.core import utils
    from megatron.core.distributed import finalize_model_grads, param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    cpu_torch = _CudaToCpuTorch()  # utils: the local (no Apex) multi-tensor l2 norm
    for mod in (
        clip_grads,
        distrib_optimizer,
        moptimizer,
        param_and_grad_buffer,
        finalize_model_grads,
        utils,
    ):
        mod.torch = cpu_torch  # type: ignore[attr-defined]
    dopt = distrib_optimizer.DistributedOptimizer
    build = dopt.__dict__["_build_model_and_main_param_groups"].__func__
    dopt._build_model_and_main_param_groups = classmethod(_cuda_type_names(build))  # type: ignore[method-assign,assignment]
    moptimizer.clip_grad_by_total_norm_fp32 = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
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
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())  # fmt: skip
        if have != (tp, pp, cp, ep):
            raise RuntimeError(
                f"megatron parallel state already initialised with tp,pp,cp,ep={have}, asked {tp},{pp},{cp},{ep}"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )  # fmt: skip
