"""Weight loading for in-place updates: safetensors files in, model tensors overwritten.

A state dict may be partial (only the tensors that changed). Every name and
shape is checked before any tensor is written, so a bad update leaves the
model as it was.

LoRA: a PEFT adapter dir (`read_lora_adapter`) is applied merge-free: the first one injects
PEFT LoRA layers into the model in place (the base weights stay as they are), each one copies
its lora_A / lora_B tensors into them. The forward is then the trainer's (trainer/lora.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_env.errors import EngineError

__all__ = ["load_safetensors", "copy_weights", "apply_update", "LoraAdapter", "read_lora_adapter"]

_ADAPTER = "default"  # the PEFT adapter slot the trainer trains (trainer/lora.py ADAPTER_NAME)
_FILE_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A PEFT adapter dir, read: its LoraConfig and its tensors under the model's parameter names."""

    name: str
    config: Any  # peft.LoraConfig
    tensors: dict[str, Any]


def read_lora_adapter(name: str, path: str | Path) -> LoraAdapter:
    from peft import LoraConfig
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    try:
        config = LoraConfig.from_pretrained(str(p))
        raw = load_file(str(p / "adapter_model.safetensors"))
    except Exception as e:
        raise EngineError(f"load_lora_adapter: cannot read adapter {str(p)!r}: {e}") from e
    tensors = {}
    for key, t in raw.items():
        module, _, kind = key.removeprefix(_FILE_PREFIX).rpartition(".lora_")
        tensors[f"{module}.lora_{kind.removesuffix('.weight')}.{_ADAPTER}.weight"] = t
    return LoraAdapter(name, config, tensors)


def _lora_shape(c: Any) -> tuple[Any, ...]:
    return c.r, c.lora_alpha, frozenset(c.target_modules or ()), frozenset(c.target_parameters or ())


def _inject_lora(model: Any, adapter: LoraAdapter) -> None:
    """Inject the adapter's LoRA layers once; a later adapter must have the same shape (r, targets).
    The shape is kept as the first adapter's file says it: PEFT rewrites the config it injects in
    place (target_modules cut to those found, target_parameters widened), so it is not comparable."""
    import torch
    from peft import inject_adapter_in_model

    if getattr(model, "peft_config", {}).get(_ADAPTER) is None:  # set by inject_adapter_in_model
        model.miles_lora_shape = _lora_shape(adapter.config)  # before PEFT rewrites the config
        with torch.inference_mode(False):  # the new layers must be ordinary tensors, not inference ones
            inject_adapter_in_model(adapter.config, model, adapter_name=_ADAPTER)
        model.requires_grad_(False)
        return
    if getattr(model, "miles_lora_shape", None) != _lora_shape(adapter.config):
        raise EngineError(f"load_lora_adapter {adapter.name!r}: rank, alpha, target modules or parameters differ from "
                          "the adapter loaded first (restart the engine to change them)")  # fmt: skip


def load_safetensors(path: str | Path) -> dict[str, Any]:
    """Read a .safetensors file, or every *.safetensors file of a directory, into one state dict."""
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise EngineError(f"update_weights_from_disk: no *.safetensors file in {str(p)!r}")
    else:
        raise EngineError(f"update_weights_from_disk: path {str(p)!r} does not exist")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise EngineError(f"update_weights_from_disk: cannot read {str(f)!r}: {e}") from e
    return state


def copy_weights(model: Any, state_dict: Mapping[str, Any]) -> None:
    """Copy `state_dict` into `model` in place (tied tensors are shared, so either name works)."""
    import torch

    params = model.state_dict(keep_vars=True)
    for name, tensor in state_dict.items():
        target = params.get(name)
        if target is None:
            raise EngineError(f"update_weights: unknown parameter {name!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise EngineError(
                f"update_weights: parameter {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, tensor in state_dict.items():
            params[name].data.copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))


def apply_update(model: Any, update: Any, current_version: int) -> None:
    """Apply a full/partial state dict, or a `WeightDelta` (miles_env.trainer.weight_delta), in place.

    A delta is checked whole before any tensor is written: base version, manifest checksum, and per
    tensor the payload and result checksums. Any failure raises EngineError and leaves the model
    untouched, so the engine's version stays where it was and a full update repairs it."""
    if isinstance(update, Mapping):
        copy_weights(model, update)
        return
    if isinstance(update, LoraAdapter):
        _inject_lora(model, update)
        copy_weights(model, update.tensors)
        return
    from miles_env.trainer.weight_delta import DeltaError, decode_entry, verify_manifest

    params = model.state_dict(keep_vars=True)
    try:
        verify_manifest(update, current_version)
        new = {}
        for entry in update.entries:
            target = params.get(entry.name)
            if target is None:
                raise DeltaError(f"unknown parameter {entry.name!r}")
            new[entry.name] = decode_entry(entry, target.data)
    except DeltaError as e:
        raise EngineError(f"apply_weight_delta refused: {e}") from e
    copy_weights(model, new)
