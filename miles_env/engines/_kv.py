"""Key/value caches as plain tensors: the batch layout and the session store.

A KV is a list (one entry per layer) of (keys, values) tensors shaped
[batch, kv_heads, length, head_dim]. The running batch is left-padded: each
row's real tokens are contiguous at the right end and a [batch, length] mask
marks them, so a decode step appends one column to every row.

`SessionStore` keeps, per session id, the token ids whose KV is cached and
that KV (batch 1, no padding), bounded by an LRU token budget; cold prompts
are kept too, so the rollouts of a GRPO group and episodes sharing a system
prompt prefill the shared part once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KV", "left_pad", "merge_rows", "select_rows", "row_kv", "crop", "SessionStore", "SessionEntry"]

KV = list[tuple[torch.Tensor, torch.Tensor]]


def left_pad(kv: KV, mask: torch.Tensor, length: int) -> tuple[KV, torch.Tensor]:
    pad = length - mask.shape[1]
    if pad <= 0:
        return kv, mask
    out: KV = []
    for k, v in kv:
        zk = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
        out.append((torch.cat([zk, k], dim=2), torch.cat([zk, v], dim=2)))
    return out, torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)


def merge_rows(a: KV, mask_a: torch.Tensor, b: KV, mask_b: torch.Tensor) -> tuple[KV, torch.Tensor]:
    """Stack two left-padded batches into one (rows of `a` first)."""
    length = max(mask_a.shape[1], mask_b.shape[1])
    a, mask_a = left_pad(a, mask_a, length)
    b, mask_b = left_pad(b, mask_b, length)
    kv = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a, b, strict=True)]
    return kv, torch.cat([mask_a, mask_b])


def select_rows(kv: KV, mask: torch.Tensor, keep: Sequence[int]) -> tuple[KV, torch.Tensor]:
    """Keep the given rows, then drop the leading columns that are padding in every row."""
    idx = torch.tensor(list(keep), dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, idx)
    used = torch.nonzero(mask.sum(dim=0) > 0)
    start = int(used[0]) if used.numel() else mask.shape[1]
    return [
        (k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in kv
    ], mask[:, start:]


def row_kv(kv: KV, row: int, n_real: int) -> KV:
    """The unpadded KV of one row (its last `n_real` columns), batch 1."""
    return [(k[row : row + 1, :, -n_real:].clone(), v[row : row + 1, :, -n_real:].clone()) for k, v in kv]


def crop(kv: KV, length: int) -> KV:
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix (binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class SessionEntry:
    ids: list[int]
    kv: KV


class SessionStore:
    """LRU store of KV prefixes by key (a session id, or a shared prompt), bounded by a token budget.

    Stored tensors are never written in place (a forward pass concatenates into new tensors), so
    any number of requests may start from views of the same entry.
    """

    def __init__(self, max_tokens: int, max_sessions: int) -> None:
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> SessionEntry | None:
        return self._entries.get(key)

    def lookup(self, ids: Sequence[int], session_id: str | None) -> tuple[SessionEntry | None, int]:
        """The entry sharing the longest prefix with `ids` (the session's own first, then any other)."""
        best: tuple[str | None, SessionEntry | None, int] = (None, None, 0)
        own = self._entries.get(session_id) if session_id else None
        if own is not None:
            best = (session_id, own, common_prefix(own.ids, ids))
        for key, entry in reversed(self._entries.items()):
            if best[2] >= len(ids) - 1:
                break
            if entry is not own and entry.ids and entry.ids[0] == ids[0]:
                n = common_prefix(entry.ids, ids)
                if n > best[2]:
                    best = (key, entry, n)
        if best[0] is not None and best[2] > 0:
            self._entries.move_to_end(best[0])
            return best[1], best[2]
        return None, 0

    def remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._tokens -= len(entry.ids)

    def put(self, key: str, entry: SessionEntry) -> None:
        self.remove(key)
        if len(entry.ids) > self.max_tokens or self.max_sessions <= 0:
            return
        self._entries[key] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self.max_tokens or len(self._entries) > self.max_sessions:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.ids)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
