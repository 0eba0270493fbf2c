"""A proven lower bound on a text's token count, from its UTF-8 length alone.

Why: refusing a prompt that cannot fit the context must not cost a full
tokenization (BPE on megabytes takes seconds). The bound is only used where it is
a proof, never an estimate:

- byte-level BPE (`pre_tokenizer` ByteLevel, alone or in a Sequence; model BPE):
  every vocabulary entry is spelled in the 256-symbol byte alphabet, one symbol per
  input byte, and BPE only merges within a pre-token, so a token stands for at most
  L = max(len(entry)) bytes. An added (special) token matches its literal content,
  L covers that too; one with lstrip/rstrip may swallow unbounded whitespace, so
  then there is no bound. A byte whose symbol is not in the vocabulary yields no
  token at all (SmolLM2 lacks 21 of the 256, e.g. 0x04, 0x16; with an unk token
  fused, a run of them yields one), so those bytes are not counted. Hence
  tokens >= ceil(counted bytes / L).
- normalizer: none keeps the bytes as they are. NFC can shorten the text, at most
  3x in UTF-8 (a Hangul L+V+T jamo triple, 9 bytes, composes to one 3-byte
  syllable; combining marks shrink it less), so L is scaled by 3. Any other
  normalizer (lowercase, strip, replace) or model (WordPiece, Unigram, or
  SentencePiece-style BPE with byte fallback, whose pieces are not bytes) gives no
  bound, and callers tokenize in full.
For SmolLM2 L = 81 (a run of spaces): 8192 tokens need at least 663,552 bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["SizeBound", "size_bound", "min_tokens"]

_SLICE = 1 << 20


@dataclass(frozen=True, slots=True)
class SizeBound:
    bytes_per_token: int  # the most input bytes one token stands for
    uncounted: bytes  # bytes that may yield no token (not in the byte alphabet of the vocabulary)


def _byte_symbols() -> dict[int, str]:
    """The ByteLevel alphabet (GPT-2's bytes_to_unicode): byte -> its one-character symbol."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _has_byte_level(pre: Any) -> bool:
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(_has_byte_level(p) for p in pre.get("pretokenizers", []))


def _shrink(normalizer: Any) -> int | None:
    """How many times a normalizer may shorten UTF-8 text (None: unknown)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type") if isinstance(normalizer, dict) else None
    if kind == "NFC":
        return 3
    if kind == "Sequence":
        factor = 1
        for n in normalizer.get("normalizers", []):
            f = _shrink(n)
            if f is None:
                return None
            factor *= f
        return factor
    return None


def size_bound(backend: Any) -> SizeBound | None:
    """The tokenizer's size bound, when there is a proof (see the module note); else None."""
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - no serializable spec: no proof, callers tokenize in full
        return None
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or not _has_byte_level(spec.get("pre_tokenizer"))
    ):
        return None
    factor = _shrink(spec.get("normalizer"))
    if factor is None:
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab = model.get("vocab") or {}
    longest = max([len(t) for t in vocab] + [len(str(t.get("content", "")).encode()) for t in added] + [1])
    uncounted = bytes(b for b, sym in _byte_symbols().items() if sym not in vocab)
    return SizeBound(longest * factor, uncounted)


def min_tokens(text: str, bound: SizeBound | None) -> int:
    """At least how many tokens `text` encodes to (0 when there is no bound)."""
    if bound is None or not text:
        return 0
    n = 0
    for k in range(0, len(text), _SLICE):  # in slices: no single step holds the GIL for long
        data = text[k : k + _SLICE].encode("utf-8", "surrogatepass")
        n += len(data.translate(None, bound.uncounted)) if bound.uncounted else len(data)
    return -(-n // bound.bytes_per_token)
