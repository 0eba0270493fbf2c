"""Megatron backend vs torch backend, and delta vs full weight sync.

Part 1: tokens/s of `MegatronTrainer.train_step` against `TorchTrainer.train_step` on the same
model and batch; steps alternate (torch, megatron, torch, ...) so load from other processes hits
both alike. Target: megatron >= 0.8x torch.

Part 2: after one RL step (the example config's lr, AdamW), sync the trainer's weights into a
real HF engine: full (every tensor) vs delta against the previous snapshot, in the engine's
dtype (bf16 target: delta <= 10% of full; fp32 shown for honesty), in process and through disk.

    python bench/bench_megatron.py [--batch 4] [--seq 128] [--steps 3] [--lr 2e-5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.megatron.backend import MegatronTrainer
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.trainer.weight_sync import WeightSyncer

sys.path.insert(0, str(Path(__file__).parent))
from bench_trainer import make_group  # noqa: E402


def part1(args: argparse.Namespace) -> MegatronTrainer:
    cfg = TrainerConfig(lr=args.lr, max_tokens_per_microbatch=args.batch * args.seq)
    groups = [make_group(args.batch, args.seq, 49152)]
    trainers = {"torch": TorchTrainer("smollm2", cfg), "megatron": MegatronTrainer("smollm2", cfg)}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    tokens = args.batch * args.seq
    for i in range(args.steps + 1):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            tr.train_step(groups)
            if i:  # the first step warms up allocators and kernels
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch"])
    print(
        f"\n### train_step, SmolLM2-135M fp32, batch {args.batch} x {args.seq} tokens, median of {args.steps}\n"
    )
    print("| backend | s/step | tokens/s | vs torch |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {tokens / m:.0f} | {base / m:.2f}x |")
    del trainers["torch"]
    return trainers["megatron"]


async def part2(args: argparse.Namespace) -> None:
    from miles_env.engines.hf import HFEngine, HFEngineConfig

    cfg = TrainerConfig(lr=args.lr)
    trainer = MegatronTrainer("smollm2", cfg)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.train_step([make_group(args.batch, args.seq, 49152)])
    after = trainer.state_dict()
    print(f"\n### weight sync after one RL step (lr {args.lr}, AdamW), SmolLM2-135M into the HF engine\n")
    print(
        "| engine dtype | kind | transport | bytes moved | vs full | sync s |\n|---|---|---|---:|---:|---:|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("bfloat16", "float32"):
            engine = HFEngine(HFEngineConfig(model="smollm2", dtype=dtype, seed=0))
            try:
                for transport in ("in_process", "disk"):
                    for kind in ("full", "delta"):
                        s = WeightSyncer(
                            mode=kind, transport=transport, dtype=getattr(torch, dtype), workdir=Path(tmp)
                        )  # type: ignore[arg-type]
                        await engine.update_weights(s._cast(before), weight_version=0)
                        s.assume(before, 0)
                        m = await s.sync(engine, after, 1)
                        assert m["sync_repaired"] == 0.0
                        ratio = m["sync_bytes"] / m["sync_full_bytes"]
                        print(f"| {dtype} | {kind} | {transport} | {m['sync_bytes'] / 2**20:.1f} MiB | "
                              f"{100 * ratio:.1f}% | {m['sync_s']:.2f} |")  # fmt: skip
                        want = s._cast(after)
                        got = engine.model.state_dict()
                        assert all(torch.equal(got[k], v) for k, v in want.items()), (
                            "engine != trainer after sync"
                        )
            finally:
                await engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    if not args.skip_train:
        del_me = part1(args)
        del del_me
    anyio.run(part2, args)


if __name__ == "__main__":
    main()
