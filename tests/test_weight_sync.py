"""Weight sync, full and delta: the codec round-trips bit for bit, and the real HF engine (SmolLM2,
bf16) applies a delta to exactly the trainer's weights, refuses corrupted / partial / wrong-base
deltas with its version unchanged, and a full sync repairs it."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import anyio
import pytest
import torch

from miles_env.errors import EngineError
from miles_env.trainer.weight_delta import decode_entry, encode_delta, load_delta, save_delta, verify_manifest
from miles_env.trainer.weight_sync import WeightSyncer


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like first step: every element moves by lr in a random direction."""
    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.randn(v.shape, generator=g).sign() for k, v in state.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_codec_round_trip_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = {
        "a": torch.randn(300, 7, generator=g),
        "b": torch.randn(50, generator=g) * 1e-3,
        "c": torch.ones(4),
    }
    new = _step(base, 1e-3, 1)
    new["b"][::5] *= -1  # sign flips: large bit-pattern differences
    new["c"] = base["c"].clone()  # unchanged: not sent
    old_c, new_c = ({k: v.to(dtype) for k, v in s.items()} for s in (base, new))
    delta = encode_delta(old_c, new_c, 3, 4)
    verify_manifest(delta, 3)
    assert {e.name for e in delta.entries} == {"a", "b"}
    for e in delta.entries:
        out = decode_entry(e, old_c[e.name])
        assert torch.equal(out.view(torch.uint8), new_c[e.name].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize(("density", "kind"), [(0.01, 0), (0.2, 1), (0.9, 2)])
def test_sparse_position_kinds_bit_exact(dtype: torch.dtype, density: float, kind: int) -> None:
    """Gaps (sparse), bitmap (middling) and every-element (dense) positions all decode bit for bit,
    including sign flips and NaN/inf patterns whose bit differences wrap around the integer width."""
    g = torch.Generator().manual_seed(1)
    old = torch.randn(20_000, generator=g).to(dtype)
    new = old.clone()
    hit = torch.rand(old.shape, generator=g) < density
    new[hit] = (old[hit].double() * (1 + 1e-2 * torch.randn(int(hit.sum()), generator=g).double())).to(dtype)
    flips = hit.nonzero().reshape(-1)[:7]
    new[flips] = -new[flips]
    new[flips[:2]] = torch.tensor([float("nan"), float("-inf")], dtype=dtype)
    delta = encode_delta({"w": old}, {"w": new}, 0, 1)
    (entry,) = delta.entries
    assert entry.kind == "sparse" and entry.payload[8] == kind
    out = decode_entry(entry, old)
    assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))
    for bad in (
        entry.payload[:-3],
        entry.payload + b"\0",
        entry.payload[:8] + bytes([7]) + entry.payload[9:],
    ):
        broken = dataclasses.replace(entry, payload=bad, payload_crc=zlib.crc32(bad))
        with pytest.raises(ValueError, match="w: "):
            decode_entry(broken, old)


def test_disk_format_round_trip_and_truncation(tmp_path: Path) -> None:
    base = {"w": torch.randn(1000).bfloat16()}
    new = {"w": (base["w"].float() + 0.05).bfloat16()}
    delta = encode_delta(base, new, 0, 1)
    path = save_delta(delta, tmp_path / "d.safetensors")
    again = load_delta(path)
    assert again == delta
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match="delta"):
        load_delta(path)


def _engine_state(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _same(engine_state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine_state[k], v.bfloat16()) for k, v in want.items())


@pytest.mark.slow
@pytest.mark.model
def test_delta_sync_real_engine(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from miles_env.engines.hf import HFEngine, HFEngineConfig
    from miles_env.models import resolve_model

    base = load_file(str(resolve_model("smollm2") / "model.safetensors"))
    v1, v2, v3 = _step(base, 2e-5, 1), None, None
    v2 = _step(v1, 2e-5, 2)
    v3 = _step(v2, 2e-5, 3)
    engine = HFEngine(HFEngineConfig(model="smollm2", dtype="bfloat16", seed=0))

    async def main() -> None:
        syncer = WeightSyncer(mode="delta", transport="in_process", dtype=torch.bfloat16, workdir=tmp_path)
        syncer.assume(base, 0)  # engine and trainer loaded the same checkpoint
        m = await syncer.sync(engine, v1, 1)
        assert (m["sync_delta"], m["sync_repaired"]) == (1.0, 0.0)
        assert 0 < m["sync_bytes"] < 0.15 * m["sync_full_bytes"]
        assert engine.weight_version == 1 and _same(_engine_state(engine), v1)

        # corrupted payload, partial delta, wrong base: refused, nothing changes
        good = encode_delta(syncer.snapshot, syncer._cast(v2), 1, 2)  # type: ignore[arg-type]
        e0 = good.entries[0]
        flipped = bytearray(e0.payload)
        flipped[len(flipped) // 2] ^= 0xFF
        corrupt = dataclasses.replace(
            good, entries=(dataclasses.replace(e0, payload=bytes(flipped)), *good.entries[1:])
        )
        partial = dataclasses.replace(good, entries=good.entries[:-1])
        wrong_base = encode_delta(syncer.snapshot, syncer._cast(v2), 0, 2)  # type: ignore[arg-type]
        before = _engine_state(engine)
        for bad in (corrupt, partial, wrong_base):
            with pytest.raises(EngineError, match="refused"):
                await engine.apply_weight_delta(bad)
            assert engine.weight_version == 1
        torch.testing.assert_close(_engine_state(engine), before, rtol=0, atol=0)
        truncated = save_delta(good, tmp_path / "t.safetensors")
        truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
        with pytest.raises(EngineError, match="refused"):
            await engine.apply_weight_delta_from_disk(truncated)
        assert engine.weight_version == 1

        # the engine diverged from the syncer's snapshot: the delta's checksums catch it; a full sync repairs
        syncer.snapshot = syncer._cast(v3)
        disk = WeightSyncer(mode="delta", transport="disk", dtype=torch.bfloat16, workdir=tmp_path)
        m = await syncer.sync(engine, v2, 2)
        assert m["sync_repaired"] == 1.0 and engine.weight_version == 2 and _same(_engine_state(engine), v2)
        disk.assume(v2, 2)
        m = await disk.sync(engine, v3, 3)  # through disk this time
        assert (m["sync_delta"], m["sync_repaired"]) == (1.0, 0.0)
        assert engine.weight_version == 3 and _same(_engine_state(engine), v3)

    try:
        anyio.run(main)
    finally:
        anyio.run(engine.close)
