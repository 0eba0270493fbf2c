"""Key/value caches as plain tensors: the batch layout and the session store.

A KV is a list (one entry per layer) of (keys, values) tensors shaped
[batch, kv_heads, length, head_dim]. The running batch is left-padded: each
row's real tokens are contiguous at the right end and a [batch, length] mask
marks them, so a decode step appends one column to every row.

`SessionStore` keeps, per session id, the token ids whose KV is cached and
that KV (batch 1, no padding), bounded by an LRU token budget. An entry is
taken out when a request uses it and put back when the request finishes, so
two requests never extend the same tensors.
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
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class SessionEntry:
    ids: list[int]
    kv: KV


class SessionStore:
    """LRU store of one KV prefix per session, bounded by a total token budget."""

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

    def take(self, session_id: str) -> SessionEntry | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._tokens -= len(entry.ids)
        return entry

    def put(self, session_id: str, entry: SessionEntry) -> None:
        self.take(session_id)
        if len(entry.ids) > self.max_tokens or self.max_sessions <= 0:
            return
        self._entries[session_id] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self.max_tokens or len(self._entries) > self.max_sessions:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.ids)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
