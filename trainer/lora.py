"""LoRA on the torch backend: PEFT adapters injected in place; only they train, checkpoint and sync.

Concept: `attach(model, cfg)` injects PEFT LoRA layers into the HF model itself
(`peft.inject_adapter_in_model`: no PeftModel wrapper, so `get_decoder()`,
`get_output_embeddings()` and `model.model.layers` keep working) and freezes every base
weight. The adapter is the set of trainable parameters, named as in the model
(`model.layers.0.self_attn.q_proj.lora_A.default.weight`).

Wire format: a PEFT adapter dir (`adapter_config.json` + `adapter_model.safetensors`, tensors
named `base_model.model.<module>.lora_{A,B}.weight`), what vLLM's `/v1/load_lora_adapter`,
SGLang's `/load_lora_adapter` and the embedded engine (`engines/_weights.py`) load.

Mixture-of-experts: `target_parameters` adapts a MoE's fused expert tensors directly (PEFT's
ParamWrapper, one low-rank pair per expert, applied as a parametrization during the forward);
`target_modules` keeps adapting the attention (and a shared expert's) linears.

Invariants: the base weights never change, bit for bit; every engine computes the same unmerged
forward (base + alpha / rank * B @ A), so the zero-KL check still holds. One adapter sync is one
weight version: `sync_adapter` loads the adapter named `policy-v{step}` and the engine's weight
version becomes the step, which every turn records (Generation.weight_version).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_env.errors import ConfigError
from miles_env.trainer.config import LoraConfig

if TYPE_CHECKING:
    import torch

    from miles_env.engines.base import Engine

__all__ = [
    "ADAPTER_NAME",
    "AdapterTrainer",
    "LoraReceiver",
    "adapter_name",
    "adapter_state",
    "attach",
    "hf_name",
    "load_adapter_state",
    "merged_state",
    "param_share",
    "save_adapter",
    "sync_adapter",
]

ADAPTER_NAME = "default"  # PEFT's adapter slot, the ".default." in the parameter names
_FILE_PREFIX = "base_model.model."  # how PEFT names a tensor in adapter_model.safetensors


def attach(model: Any, cfg: LoraConfig) -> None:
    """Inject LoRA layers into `model` in place and make them its only trainable parameters."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules), bias="none",
        target_parameters=list(cfg.target_parameters) or None,
    )  # fmt: skip
    try:
        inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER_NAME)
    except (ValueError, RuntimeError) as e:  # no module (or parameter) matched
        targets = list(cfg.target_modules) + list(cfg.target_parameters)
        raise ConfigError(f"trainer.lora target_modules / target_parameters {targets}: {e}") from e
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (detached, on their device), named as in the model."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(adapter_state(model)) ^ set(state))
    if missing:
        raise ConfigError(f"checkpoint adapter does not match trainer.lora: {missing[0]!r} differs")
    with torch.no_grad():
        for name, t in state.items():
            params[name].copy_(t)


def param_share(model: Any) -> float:
    """Adapter parameters / base parameters (tied tensors counted once)."""
    seen: set[int] = set()
    base = adapter = 0
    for _, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.requires_grad:
            adapter += p.numel()
        else:
            base += p.numel()
    return adapter / max(base, 1)


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """HF-named full weights with the adapter merged in (W + scale * B @ A): what a full sync or an
    exported checkpoint carries. The model itself stays unmerged."""
    import torch
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import ParamWrapper

    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if isinstance(mod, LoraLinear | ParamWrapper) and ADAPTER_NAME in mod.lora_A:
                param = mod.parameter_name if isinstance(mod, ParamWrapper) else "weight"
                deltas[hf_name(f"{mod_name}.{param}")] = mod.get_delta_weight(ADAPTER_NAME)
        out: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict().items():
            if ".lora_" in name:
                continue
            hf = hf_name(name)
            out[hf] = t.detach() + deltas[hf].to(t.dtype) if hf in deltas else t.detach()
    return out


def hf_name(name: str) -> str:
    """The HF name of a tensor inside PEFT's wrappers: every `.base_layer` segment dropped
    (`q_proj.base_layer.weight`; nested ParamWrappers: `experts.base_layer.base_layer.gate_up_proj`)."""
    return re.sub(r"\.base_layer(?=\.)", "", name)


def adapter_name(step: int) -> str:
    return f"policy-v{step}"


def save_adapter(
    model: Any, cfg: LoraConfig, path: Path, base_model: str, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write a PEFT adapter dir at `path` (atomic: a tmp dir, then rename); `state`: the adapter's
    full tensors when the model's are shards (FSDP2), else read from `model`."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {
        _FILE_PREFIX + n.replace(f".{ADAPTER_NAME}.", "."): t.contiguous().cpu()
        for n, t in (adapter_state(model) if state is None else state).items()
    }
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
        target_modules=sorted(cfg.target_modules), base_model_name_or_path=base_model,
        target_parameters=sorted(cfg.target_parameters) or None,
    ).save_pretrained(str(tmp))  # fmt: skip
    if path.exists():
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


@runtime_checkable
class AdapterTrainer(Protocol):
    """A trainer that can train LoRA adapters (the torch backend); `lora` is None when it trains
    every weight."""

    @property
    def lora(self) -> LoraConfig | None: ...

    def export_adapter(self, path: str | os.PathLike[str]) -> Path: ...

    def full_weight_bytes(self) -> int: ...


@runtime_checkable
class LoraReceiver(Protocol):
    """An engine that loads PEFT adapter dirs at run time, merge-free (hf, vllm, sglang)."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str | Path, weight_version: int) -> int: ...


async def sync_adapter(trainer: AdapterTrainer, engine: Engine, step: int, workdir: Path) -> dict[str, float]:
    """Export the adapter and have `engine` load it as weight version `step`. Metrics: sync_bytes (the
    adapter file), sync_full_bytes (what a full sync would move), sync_s, sync_lora = 1."""
    import anyio

    if not isinstance(engine, LoraReceiver):
        raise ConfigError(f"trainer.lora: engine {type(engine).__name__} cannot load LoRA adapters")
    t0 = time.perf_counter()
    name = adapter_name(step)
    path = await anyio.to_thread.run_sync(trainer.export_adapter, workdir / name)
    await engine.load_lora_adapter(name, path, step)
    for old in workdir.glob("policy-v*"):  # the engine has read it; keep only the served one
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    moved = (path / "adapter_model.safetensors").stat().st_size
    return {"sync_bytes": float(moved), "sync_full_bytes": float(trainer.full_weight_bytes()),
            "sync_s": time.perf_counter() - t0, "sync_lora": 1.0}  # fmt: skip
