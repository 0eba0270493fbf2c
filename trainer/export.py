"""Weights out as an HF checkpoint folder: what `update_weights_from_disk` and every engine load.

Concept: `write_hf_dir(state, hf_config, target)` writes `model.safetensors` (the HF names and
the checkpoint layout the backend already made with `miles_env.weight_layout.to_checkpoint`: a
MoE's experts one tensor each) and `config.json`. Both backends' `export_weights` end here, on the
rank that writes, after every rank took part in gathering `state`.

Invariants: tied tensors (lm_head = embed_tokens) are stored once, as `save_pretrained` does; the
folder appears whole: it is written under a tmp name beside `target`, then renamed over it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["write_hf_dir"]


def write_hf_dir(state: Mapping[str, torch.Tensor], hf_config: Any, target: Path) -> Path:
    """`state` (HF-named, checkpoint layout) and `hf_config` (a transformers PretrainedConfig) as
    the HF checkpoint folder `target`, replacing what was there."""
    from safetensors.torch import save_file

    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        if t.data_ptr() in seen:
            continue  # tied (lm_head = embed_tokens)
        seen.add(t.data_ptr())
        tensors[name] = t.contiguous().cpu()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    hf_config.to_json_file(str(tmp / "config.json"))
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    return target
