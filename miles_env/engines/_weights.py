"""Weight loading for in-place updates: safetensors files in, model tensors overwritten.

A state dict may be partial (only the tensors that changed). Every name and
shape is checked before any tensor is written, so a bad update leaves the
model as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_env.errors import EngineError

__all__ = ["load_safetensors", "copy_weights", "apply_update"]


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
    """Apply a full/partial state dict, or a `WeightDelta` (miles_env.trainer.weight_sync), in place.

    A delta is checked whole before any tensor is written: base version, manifest checksum, and per
    tensor the payload and result checksums. Any failure raises EngineError and leaves the model
    untouched, so the engine's version stays where it was and a full update repairs it."""
    if isinstance(update, Mapping):
        copy_weights(model, update)
        return
    from miles_env.trainer.weight_sync import DeltaError, decode_entry, verify_manifest

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
