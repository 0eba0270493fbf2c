"""Weight sync from trainer to engine: full (every tensor) or delta (only what changed).

Concept: `WeightSyncer` keeps the last snapshot the engine accepted, in the engine's dtype.
A delta compares the new weights (cast to that dtype) with the snapshot, and per tensor
sends nothing (unchanged), a sparse encoding (positions as gaps, values as the integer
difference of the bit patterns, zigzag-coded, split into byte planes and zlib-compressed:
after a small optimizer step most bf16 elements move by at most one ulp), or the dense
tensor, whichever is smaller.

Invariants: a delta names its base version and its new version and carries a crc32 of every
changed tensor's new bytes, of every payload, and of its manifest. The engine applies a delta
only if its version is the base version and every check passes, all-or-nothing
(`apply_delta`); otherwise it refuses with its weights and version unchanged, and the
syncer repairs with a full sync. After a delta the engine's tensors equal the trainer's
weights cast to the engine dtype, bit for bit.

Wire format on disk: one safetensors file, payloads as uint8 tensors, the manifest as JSON
metadata. In process the WeightDelta object itself is handed over.

This module imports no engine: the engine imports `decode_entry` / `WeightDelta` from here.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "DeltaEntry",
    "WeightDelta",
    "DeltaError",
    "encode_delta",
    "decode_entry",
    "save_delta",
    "load_delta",
    "tensor_crc",
    "WeightSyncer",
]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that cannot be applied (wrong base, corrupted, partial)."""


@dataclass(frozen=True, slots=True)
class DeltaEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    kind: Literal["dense", "sparse"]
    payload: bytes  # dense: raw new bytes; sparse: see _encode_sparse
    crc: int  # crc32 of the new tensor's bytes
    payload_crc: int

    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
                "crc": self.crc, "payload_crc": self.payload_crc, "nbytes": len(self.payload)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightDelta:
    base_version: int
    new_version: int
    entries: tuple[DeltaEntry, ...]
    manifest_crc: int
    full_bytes: int  # what a full sync would move, for the ratio

    @property
    def nbytes(self) -> int:
        return sum(len(e.payload) for e in self.entries)


def _manifest_crc(base: int, new: int, metas: list[dict[str, Any]]) -> int:
    return zlib.crc32(json.dumps([base, new, metas], sort_keys=True).encode())


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def tensor_crc(t: torch.Tensor) -> int:
    return zlib.crc32(_bytes(t))


def _int_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat native-width integer array (a view, no widening)."""
    return t.detach().contiguous().cpu().reshape(-1).view(_BITS[t.element_size()]).numpy()


def _planes(values: np.ndarray) -> bytes:
    """uint64 values -> their k low byte planes (k = bytes of the largest value), each stored as
    flag + length + data: zlib-compressed when a 64 KiB sample compresses well (gaps, high bytes,
    one-ulp bf16 steps), raw when it does not (low bytes of fp32 steps are near random)."""
    k = max(1, (int(values.max()).bit_length() + 7) // 8) if values.size else 1
    raw = values.astype("<u8").view(np.uint8).reshape(-1, 8)
    out = [bytes([k])]
    for j in range(k):
        plane = np.ascontiguousarray(raw[:, j]).tobytes()
        sample = plane[: 1 << 16]
        packed = len(zlib.compress(sample, 1)) < 0.9 * len(sample)
        data = zlib.compress(plane, 1) if packed else plane
        out.append(bytes([packed]) + len(data).to_bytes(8, "little") + data)
    return b"".join(out)


def _unplanes(blob: bytes, n: int) -> np.ndarray:
    k = blob[0] if blob else 0
    if not 1 <= k <= 8:
        raise DeltaError(f"sparse payload has {k} byte planes")
    full = np.zeros((n, 8), dtype=np.uint8)
    pos = 1
    for j in range(k):
        packed, size = blob[pos], int.from_bytes(blob[pos + 1 : pos + 9], "little")
        data = blob[pos + 9 : pos + 9 + size]
        pos += 9 + size
        plane = np.frombuffer(zlib.decompress(data) if packed else data, dtype=np.uint8)
        if plane.size != n:
            raise DeltaError(f"sparse byte plane {j} holds {plane.size} bytes, expected {n}")
        full[:, j] = plane
    return full.view("<u8").reshape(-1)


def _encode_sparse(old: np.ndarray, new: np.ndarray, idx: np.ndarray) -> bytes:
    gaps = np.diff(idx, prepend=-1).astype(np.uint64)
    d = new[idx].astype(np.int64) - old[idx].astype(np.int64)  # widened on changed elements only
    zig = ((d << 1) ^ (d >> 63)).astype(np.uint64)
    a, b = _planes(gaps), _planes(zig)
    return len(idx).to_bytes(8, "little") + len(a).to_bytes(8, "little") + a + b


def _decode_sparse(current: torch.Tensor, payload: bytes) -> torch.Tensor:
    """A new tensor: `current` with the payload's changed bit patterns written in."""
    n = int.from_bytes(payload[:8], "little")
    la = int.from_bytes(payload[8:16], "little")
    gaps = _unplanes(payload[16 : 16 + la], n).astype(np.int64)
    zig = _unplanes(payload[16 + la :], n)
    d = (zig >> np.uint64(1)).astype(np.int64) ^ -(zig & np.uint64(1)).astype(np.int64)
    idx = np.cumsum(gaps) - 1
    if n and (idx[-1] >= current.numel() or idx[0] < 0):
        raise DeltaError("sparse positions fall outside the tensor")
    bits = _int_bits(current).copy()  # a plain memcpy (torch's bf16 clone is several times slower on CPU)
    bits[idx] = (bits[idx].astype(np.int64) + d).astype(bits.dtype)
    return torch.from_numpy(bits).view(current.dtype).reshape(current.shape)


def _entry(name: str, old: torch.Tensor | None, new: torch.Tensor) -> DeltaEntry | None:
    """The cheaper of sparse and dense for one tensor; None when unchanged."""
    dtype = str(new.dtype).removeprefix("torch.")
    size = new.numel() * new.element_size()
    if old is not None and old.shape == new.shape and old.dtype == new.dtype:
        ob, nb = _int_bits(old), _int_bits(new)
        idx = np.flatnonzero(ob != nb)
        if idx.size == 0:
            return None
        # a sparse element costs >= ~1 byte after compression: past half the tensor, dense wins anyway
        if idx.size * 2 < size:
            payload = _encode_sparse(ob, nb, idx)
            if len(payload) < size:
                return DeltaEntry(
                    name, tuple(new.shape), dtype, "sparse", payload, tensor_crc(new), zlib.crc32(payload)
                )
    payload = bytes(_bytes(new))  # dense: the payload is the tensor's bytes, one crc serves both
    crc = zlib.crc32(payload)
    return DeltaEntry(name, tuple(new.shape), dtype, "dense", payload, crc, crc)


def encode_delta(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], base_version: int, new_version: int
) -> WeightDelta:
    """Delta from `old` to `new` (both already in the engine dtype, same names)."""
    entries = tuple(e for name, t in new.items() if (e := _entry(name, old.get(name), t)) is not None)
    metas = [e.meta() for e in entries]
    full = sum(t.numel() * t.element_size() for t in new.values())
    return WeightDelta(
        base_version, new_version, entries, _manifest_crc(base_version, new_version, metas), full
    )


def decode_entry(entry: DeltaEntry, current: torch.Tensor) -> torch.Tensor:
    """The new tensor of `entry`, given the engine's current one; checks every crc."""
    if zlib.crc32(entry.payload) != entry.payload_crc:
        raise DeltaError(f"{entry.name}: payload checksum mismatch (corrupted delta)")
    if tuple(current.shape) != entry.shape or str(current.dtype).removeprefix("torch.") != entry.dtype:
        raise DeltaError(f"{entry.name}: delta is for {entry.dtype}{list(entry.shape)}, engine holds "
                         f"{current.dtype}{list(current.shape)}")  # fmt: skip
    if entry.kind == "dense":
        flat = torch.frombuffer(bytearray(entry.payload), dtype=current.dtype)
        if flat.numel() != current.numel():
            raise DeltaError(
                f"{entry.name}: dense payload has {flat.numel()} elements, expected {current.numel()}"
            )
        new = flat.reshape(current.shape)
    else:
        try:
            new = _decode_sparse(current, entry.payload)
        except (zlib.error, ValueError, IndexError) as e:
            raise DeltaError(f"{entry.name}: cannot decode sparse payload: {e}") from e
    if entry.kind == "sparse" and tensor_crc(new) != entry.crc:  # dense: payload crc checked above
        raise DeltaError(
            f"{entry.name}: result checksum mismatch (engine weights differ from the delta's base)"
        )
    return new


def verify_manifest(delta: WeightDelta, current_version: int) -> None:
    if delta.base_version != current_version:
        raise DeltaError(f"delta base_version={delta.base_version}, engine is at version {current_version}")
    metas = [e.meta() for e in delta.entries]
    if _manifest_crc(delta.base_version, delta.new_version, metas) != delta.manifest_crc:
        raise DeltaError("delta manifest checksum mismatch (partial or corrupted delta)")


def save_delta(delta: WeightDelta, path: str | os.PathLike[str]) -> Path:
    """One safetensors file (payloads as uint8 tensors, manifest as metadata), written atomically."""
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"{i}": torch.frombuffer(bytearray(e.payload), dtype=torch.uint8) if e.payload else torch.empty(0, dtype=torch.uint8)
               for i, e in enumerate(delta.entries)}  # fmt: skip
    head = {"base_version": delta.base_version, "new_version": delta.new_version,
            "manifest_crc": delta.manifest_crc, "full_bytes": delta.full_bytes,
            "entries": [e.meta() for e in delta.entries]}  # fmt: skip
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"miles_env_delta": json.dumps(head)})
    os.replace(tmp, target)
    return target


def load_delta(path: str | os.PathLike[str]) -> WeightDelta:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            head = json.loads((f.metadata() or {})["miles_env_delta"])
            payloads = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # truncated or foreign file
        raise DeltaError(f"cannot read delta {str(path)!r}: {e}") from e
    entries = []
    for i, m in enumerate(head["entries"]):
        t = payloads.get(f"{i}")
        payload = t.numpy().tobytes() if t is not None else b""
        entries.append(
            DeltaEntry(
                m["name"], tuple(m["shape"]), m["dtype"], m["kind"], payload, m["crc"], m["payload_crc"]
            )
        )
    return WeightDelta(
        head["base_version"], head["new_version"], tuple(entries), head["manifest_crc"], head["full_bytes"]
    )


@dataclass
class WeightSyncer:
    """Trainer-side sync policy. mode: full | delta; transport: in_process | disk."""

    mode: Literal["full", "delta"] = "delta"
    transport: Literal["in_process", "disk"] = "in_process"
    dtype: torch.dtype = torch.float32  # the engine's dtype
    workdir: Path = Path("weights")
    snapshot: dict[str, torch.Tensor] | None = None
    version: int | None = None  # engine version of `snapshot`
    history: list[dict[str, float]] = field(default_factory=list)

    def _cast(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen: dict[int, str] = {}
        out = {}
        for name, t in state.items():
            if t.data_ptr() in seen:
                continue  # tied: sent once, the engine shares the storage
            seen[t.data_ptr()] = name
            out[name] = t.detach().to(device="cpu", dtype=self.dtype, copy=True).contiguous()
        return out

    def assume(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take `state` as what the engine holds at `version` (e.g. both loaded the same checkpoint), so
        the first sync can already be a delta. If that is wrong, the engine refuses and we repair."""
        self.snapshot, self.version = self._cast(state), version

    async def sync(self, engine: Any, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Move `state` to `engine` as `version`; returns metrics (sync_bytes, sync_full_bytes, sync_s,
        sync_delta 1/0, sync_repaired 1/0)."""
        import anyio

        t0 = time.perf_counter()
        new = await anyio.to_thread.run_sync(self._cast, state)
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        repaired = 0.0
        moved = float(full_bytes)
        can_delta = self.mode == "delta" and hasattr(engine, "apply_weight_delta")
        used_delta = can_delta and self.snapshot is not None and self.version is not None
        if used_delta:
            assert self.snapshot is not None and self.version is not None
            delta = await anyio.to_thread.run_sync(encode_delta, self.snapshot, new, self.version, version)
            moved = float(delta.nbytes)
            try:
                await self._send_delta(engine, delta)
            except Exception:  # refused (or lost): the engine kept its weights; repair with a full sync
                repaired, moved = 1.0, moved + full_bytes
                await self._send_full(engine, new, version)
        else:
            await self._send_full(engine, new, version)
        self.snapshot, self.version = new, version
        m = {"sync_bytes": moved, "sync_full_bytes": float(full_bytes), "sync_s": time.perf_counter() - t0,
             "sync_delta": float(used_delta), "sync_repaired": repaired}  # fmt: skip
        self.history.append(m)
        return m

    async def _send_full(self, engine: Any, new: dict[str, torch.Tensor], version: int) -> None:
        if self.transport == "in_process":
            await engine.update_weights(new, weight_version=version)
            return
        from safetensors.torch import save_file

        path = self.workdir / "full.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(new, str(path))
        await engine.update_weights_from_disk(path, weight_version=version)

    async def _send_delta(self, engine: Any, delta: WeightDelta) -> None:
        if self.transport == "in_process":
            await engine.apply_weight_delta(delta)
        else:
            await engine.apply_weight_delta_from_disk(save_delta(delta, self.workdir / "delta.safetensors"))
