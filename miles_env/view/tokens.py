"""Token ids -> text pieces, for display only.

The ids are the truth (they are what the trainer used); text is derived from them with the run's
tokenizer (config.yaml's engine.model, or `--model`) one id at a time, so piece i is exactly token
i. A piece that is part of a multi-byte character shows as the replacement character; the id is
always shown beside it. Pieces are cached per id; the tokenizer loads once, on first use, and a
tokenizer that cannot be loaded leaves the view showing ids.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Pieces"]


class Pieces:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._tok: Any = None
        self._failed: str | None = None
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._tok is None and self._failed is None and self.model:
            try:
                from miles_env.models import load_tokenizer

                self._tok = load_tokenizer(self.model)
            except Exception as e:  # display only: the view falls back to ids
                self._failed = f"{type(e).__name__}: {e}"
        return self._tok

    @property
    def error(self) -> str | None:
        return self._failed if self.model else "no tokenizer: pass --model"

    def decode(self, ids: Sequence[int]) -> str:
        """A run of ids as one text (multi-byte characters whole); ids when there is no tokenizer."""
        with self._lock:
            tok = self._tokenizer()
            return str(tok.decode(list(ids))) if tok is not None else " ".join(f"[{i}]" for i in ids)

    def pieces(self, ids: Sequence[int]) -> list[str] | None:
        with self._lock:
            tok = self._tokenizer()
            if tok is None:
                return None
            cache = self._cache
            missing = sorted({i for i in ids if i not in cache})
            for i in missing:
                cache[i] = tok.decode([i])
            return [cache[i] for i in ids]
