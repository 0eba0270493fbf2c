"""Weight sync from trainer to engine: full or delta, in process or through disk.

Concept: `WeightSyncer` keeps the last snapshot the engine accepted, in the engine's dtype. A
delta sync encodes the new weights against it (weight_delta.py, the format) and sends the
`WeightDelta`; a full sync sends every tensor. Transports: `in_process` hands tensors or the delta
object to an engine in this process; `disk` writes a safetensors file (a full one in the
checkpoint layout any engine loads, or a `save_delta` file) and asks the engine to load it.
Engines that take deltas are `DeltaReceiver`s (the hf engine); any other gets full syncs through
disk.

Invariant: the engine ends every sync at the trainer's weights cast to its dtype and at the
sync's version: a delta the engine refuses (wrong base, corrupted) leaves it unchanged, and the
syncer repairs with a full sync in the same call (`sync_repaired`).

Lifecycle: `WeightSyncer(mode, transport, dtype, workdir)`; optionally `assume(state, version)`
when both sides loaded the same weights, so the first sync can be a delta; `sync(engine, state,
version)` after each step, returning its metrics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch

from miles_env.trainer.weight_delta import WeightDelta, encode_delta, save_delta

if TYPE_CHECKING:
    from miles_env.engines.base import Engine

__all__ = ["DeltaReceiver", "WeightSyncer"]


@runtime_checkable
class DeltaReceiver(Protocol):
    """The engine side of this module's format (the hf engine): takes tensors in process and applies
    deltas, in process or from a `save_delta` file. Any other engine gets full syncs through disk."""

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], weight_version: int | None = None
    ) -> int: ...

    async def apply_weight_delta(self, delta: WeightDelta) -> int: ...

    async def apply_weight_delta_from_disk(self, path: str | Path) -> int: ...


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

    async def sync(self, engine: Engine, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Move `state` to `engine` as `version`; returns metrics (sync_bytes, sync_full_bytes, sync_s,
        sync_delta 1/0, sync_repaired 1/0)."""
        import anyio

        t0 = time.perf_counter()
        new = await anyio.to_thread.run_sync(self._cast, state)
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        repaired = 0.0
        moved = float(full_bytes)
        receiver = engine if self.mode == "delta" and isinstance(engine, DeltaReceiver) else None
        used_delta = False
        if receiver is not None and self.snapshot is not None and self.version is not None:
            used_delta = True
            delta = await anyio.to_thread.run_sync(encode_delta, self.snapshot, new, self.version, version)
            moved = float(delta.nbytes)
            try:
                await self._send_delta(receiver, delta)
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

    async def _send_full(self, engine: Engine, new: dict[str, torch.Tensor], version: int) -> None:
        if self.transport == "in_process" and isinstance(engine, DeltaReceiver):
            await engine.update_weights(new, weight_version=version)
            return
        from safetensors.torch import save_file

        from miles_env.weight_layout import to_checkpoint

        path = self.workdir / "full.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        # the checkpoint files' layout (MoE: one tensor per expert), what any engine loads from disk
        save_file({k: v.contiguous() for k, v in to_checkpoint(new).items()}, str(path))
        await engine.update_weights_from_disk(path, weight_version=version)

    async def _send_delta(self, engine: DeltaReceiver, delta: WeightDelta) -> None:
        if self.transport == "in_process":
            await engine.apply_weight_delta(delta)
        else:
            await engine.apply_weight_delta_from_disk(save_delta(delta, self.workdir / "delta.safetensors"))
