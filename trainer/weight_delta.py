"""The weight-delta format: what changed between two weight versions, checked and compact.

Concept: `encode_delta(old, new, base, new_version)` compares two state dicts (already in the
engine's dtype) and per tensor keeps nothing (unchanged), a sparse encoding, or the dense tensor,
whichever is smaller. Sparse: values are the difference of the bit patterns modulo 2^bits in the
tensor's own width, zigzag-coded, split into byte planes and zlib-compressed (after a small
optimizer step most bf16 elements move by at most one ulp); positions, by density, are gaps (few
changed: bf16), a bitmap, or none (most changed: fp32; every element's difference is sent).
`decode_entry(entry, current)` is the receiving side, one tensor at a time.

Invariants: a delta names its base version and its new version and carries a crc32 of every
changed tensor's new bytes, of every payload, and of its manifest. A receiver applies a delta only
if its version is the base version and every check passes (`verify_manifest`, then `decode_entry`
per tensor, all before any write: engines/_weights.py's `apply_update`); otherwise a `DeltaError`
leaves its weights and version unchanged. After a delta the receiver's tensors equal the new
weights bit for bit.

Wire format on disk (`save_delta` / `load_delta`): one safetensors file, payloads as uint8
tensors, the manifest as JSON metadata. In process the WeightDelta object itself is handed over.

This module is the one piece of the trainer the engine side imports (INVARIANTS.md); it imports
no engine. Who sends what, and how, is weight_sync.py.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from miles_env.jsonio import dumps

__all__ = [
    "DeltaEntry",
    "WeightDelta",
    "DeltaError",
    "encode_delta",
    "decode_entry",
    "verify_manifest",
    "save_delta",
    "load_delta",
    "tensor_crc",
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


def _pack(data: bytes) -> bytes:
    """flag + length + data: zlib-compressed when a 64 KiB sample compresses well (gaps, high bytes,
    sparse bitmaps), raw when it does not (low bytes of fp32 steps, dense bitmaps are near random)."""
    packed = len(zlib.compress(data[: 1 << 16], 1)) < 0.9 * min(len(data), 1 << 16)
    body = zlib.compress(data, 1) if packed else data
    return bytes([packed]) + len(body).to_bytes(8, "little") + body


def _unpack(blob: bytes, pos: int) -> tuple[bytes, int]:
    packed, size = blob[pos], int.from_bytes(blob[pos + 1 : pos + 9], "little")
    body = blob[pos + 9 : pos + 9 + size]
    if len(body) != size:
        raise DeltaError("sparse payload is truncated")
    return (zlib.decompress(body) if packed else body), pos + 9 + size


def _planes(values: np.ndarray) -> bytes:
    """Unsigned values -> their k low byte planes (k = bytes of the largest value), each `_pack`ed."""
    width = values.dtype.itemsize
    k = max(1, (int(values.max()).bit_length() + 7) // 8) if values.size else 1
    raw = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
    return bytes([k]) + b"".join(_pack(np.ascontiguousarray(raw[:, j]).tobytes()) for j in range(k))


def _unplanes(blob: bytes, pos: int, n: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    k, width = (blob[pos] if pos < len(blob) else 0), np.dtype(dtype).itemsize
    if not 1 <= k <= width:
        raise DeltaError(f"sparse payload has {k} byte planes for {width}-byte values")
    full = np.zeros((n, width), dtype=np.uint8)
    pos += 1
    for j in range(k):
        plane, pos = _unpack(blob, pos)
        if len(plane) != n:
            raise DeltaError(f"sparse byte plane {j} holds {len(plane)} bytes, expected {n}")
        full[:, j] = np.frombuffer(plane, dtype=np.uint8)
    return full.view(np.dtype(dtype).newbyteorder("<")).reshape(-1), pos


_GAPS, _BITMAP, _EVERY = 0, 1, 2


def _encode_sparse(old: np.ndarray, new: np.ndarray, changed: np.ndarray, count: int) -> bytes:
    """n | position kind | positions | values. Values: the bit-pattern difference new - old modulo
    2^bits in the tensor's own width (no widening; wrap-around is exact), zigzag-coded so small steps
    of either sign have small codes, as byte planes. Positions by density: past half the elements,
    none (every element's difference is sent, zeros included: no scan, no gather); past 1 in 8, a
    bitmap (1 bit each); below, gaps as byte planes (sparse bf16 steps)."""
    d = new - old  # integer arrays wrap modulo 2^bits
    if count * 2 >= changed.size:
        positions = bytes([_EVERY])
    elif count * 8 >= changed.size:
        positions = bytes([_BITMAP]) + _pack(np.packbits(changed).tobytes())
        d = d[changed]
    else:
        idx = np.flatnonzero(changed)
        positions = bytes([_GAPS]) + _planes(np.diff(idx, prepend=-1).astype(np.uint64))
        d = d[idx]
    d = d.view(f"i{d.itemsize}")
    zig = (d << 1) ^ (d >> (8 * d.itemsize - 1))
    return d.size.to_bytes(8, "little") + positions + _planes(zig.view(f"u{d.itemsize}"))


def _decode_sparse(current: torch.Tensor, payload: bytes) -> torch.Tensor:
    """A new tensor: `current` with the payload's changed bit patterns written in."""
    n, kind = int.from_bytes(payload[:8], "little"), payload[8] if len(payload) > 8 else -1
    bits = _int_bits(current).copy()  # a plain memcpy (torch's bf16 clone is several times slower on CPU)
    idx: np.ndarray | slice
    pos = 9
    if kind == _EVERY:
        idx = slice(None)
        if n != bits.size:
            raise DeltaError(f"sparse payload holds {n} differences for {bits.size} elements")
    elif kind == _BITMAP:
        packed, pos = _unpack(payload, pos)
        idx = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=bits.size).view(bool)
        if int(np.count_nonzero(idx)) != n:
            raise DeltaError("sparse bitmap does not match its count")
    elif kind == _GAPS:
        gaps, pos = _unplanes(payload, pos, n, np.dtype(np.uint64))
        idx = np.cumsum(gaps.astype(np.int64)) - 1
        if n and (idx[-1] >= current.numel() or idx[0] < 0):
            raise DeltaError("sparse positions fall outside the tensor")
    else:
        raise DeltaError(f"sparse payload has position kind {kind}")
    zig, pos = _unplanes(payload, pos, n, np.dtype(f"u{bits.itemsize}"))
    if pos != len(payload):
        raise DeltaError("sparse payload has trailing bytes")
    d = (zig >> 1).view(bits.dtype) ^ -(zig & 1).view(bits.dtype)
    bits[idx] += d  # modulo 2^bits, as encoded
    return torch.from_numpy(bits).view(current.dtype).reshape(current.shape)


def _entry(name: str, old: torch.Tensor | None, new: torch.Tensor) -> DeltaEntry | None:
    """The cheaper of sparse and dense for one tensor; None when unchanged."""
    dtype = str(new.dtype).removeprefix("torch.")
    size = new.numel() * new.element_size()
    if old is not None and old.shape == new.shape and old.dtype == new.dtype:
        ob, nb = _int_bits(old), _int_bits(new)
        changed = ob != nb
        count = int(np.count_nonzero(changed))
        if count == 0:
            return None
        # a sparse element costs >= ~1 byte after compression: past half the tensor, dense wins anyway
        if count * 2 < size:
            payload = _encode_sparse(ob, nb, changed, count)
            if len(payload) < size:
                return DeltaEntry(
                    name, tuple(new.shape), dtype, "sparse", payload, tensor_crc(new), zlib.crc32(payload)
                )
    payload = bytes(_bytes(new))  # dense: the payload is the tensor's bytes, one crc serves both
    crc = zlib.crc32(payload)
    return DeltaEntry(name, tuple(new.shape), dtype, "dense", payload, crc, crc)


def encode_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    base_version: int,
    new_version: int,
    workers: int | None = None,
) -> WeightDelta:
    """Delta from `old` to `new` (both already in the engine dtype, same names). Tensors are encoded
    on `workers` threads (default: up to 8, one per core): numpy and zlib release the GIL."""
    names = list(new)
    n = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n) as pool:
        found = pool.map(lambda k: _entry(k, old.get(k), new[k]), names)
        entries = tuple(e for e in found if e is not None)
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
    save_file(tensors, str(tmp), metadata={"miles_env_delta": dumps(head)})
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
