"""What a remote engine's client reads from the model directory instead of asking the server.

Real SGLang and vLLM servers do not report the model's EOS ids (SGLang's `/get_server_info`
has no such field), yet the proxy must stop on them. Both servers stop on the union of the
tokenizer's EOS and the `eos_token_id` of config.json / generation_config.json, so the
clients read the same files: generation_config.json first (int or list), then config.json,
then the tokenizer's `eos_token` (tokenizer_config.json, looked up in tokenizer.json), in that
order, without duplicates. Only JSON is read: no transformers import, no hub access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["model_eos_ids", "local_model_dir"]


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(raw: Any) -> list[int]:
    items = raw if isinstance(raw, list) else [raw]
    return [int(i) for i in items if isinstance(i, int) and not isinstance(i, bool)]


def _tokenizer_eos(model_dir: Path) -> list[int]:
    token = _json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return []
    tok = _json(model_dir / "tokenizer.json")
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return [int(added["id"])]
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return [int(vocab[token])]
    return []


def model_eos_ids(model_dir: str | Path | None) -> tuple[int, ...]:
    """The EOS ids of an HF model directory (see the module docstring); () when it has none."""
    if model_dir is None:
        return ()
    root = Path(model_dir)
    found: list[int] = []
    for ids in (
        _ids(_json(root / "generation_config.json").get("eos_token_id")),
        _ids(_json(root / "config.json").get("eos_token_id")),
        _tokenizer_eos(root),
    ):
        found += [i for i in ids if i not in found]
    return tuple(found)


def local_model_dir(reported: Any, configured: Path | None) -> Path | None:
    """The model dir to read: the server's reported model path when it is a local HF dir, else ours."""
    if isinstance(reported, str) and reported and (Path(reported) / "config.json").is_file():
        return Path(reported)
    return configured
