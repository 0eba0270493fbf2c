"""FSDP2 on the torch backend: one GRPO step of SmolLM2 on 1 process against 2 gloo ranks (CPU).

Each world runs in its own child (the 2-rank one under torchrun) on the same synthetic GRPO group
(bench_trainer.make_group: fixed token ids, half the episodes rewarded): one warm-up train_step,
then `--steps` timed ones, median reported; each rank's peak RSS (ru_maxrss) is gathered to rank 0.
The 2-rank step must report the single process's loss and grad norm (it is data parallel with a
summed gradient): the table shows both. Ratios only: the machine's cores are shared.

    python bench/bench_fsdp2.py [--batch 4] [--seq 128] [--steps 2] [--lora 0] [--out bench/results/fsdp2.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_trainer import make_group

    from miles_env.trainer.config import LoraConfig, TrainerConfig
    from miles_env.trainer.torch_backend import TorchTrainer

    lora = LoraConfig(rank=args.lora, alpha=2 * args.lora) if args.lora else None
    trainer = TorchTrainer("smollm2", TrainerConfig(lr=1e-5, lora=lora, max_tokens_per_microbatch=args.seq))
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    groups = [make_group(args.batch, args.seq, vocab)]
    trainer.train_step(groups)  # warm-up
    times, metrics = [], {}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rss_all = [rss]
    if trainer.sharded:
        rss_all = [0.0] * trainer.world.world
        dist.all_gather_object(rss_all, rss)
    if trainer.world.rank == 0:
        out = {"step_s": statistics.median(times), "rss_gb": rss_all, "loss": metrics["loss"]}
        out["grad_norm"] = metrics["grad_norm"]
        Path(args.result).write_text(json.dumps(out))
    if trainer.sharded:
        dist.barrier()
        dist.destroy_process_group()


def run(world: int, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    flags = ["--child", "--result", str(result), "--batch", str(args.batch), "--seq", str(args.seq),
             "--steps", str(args.steps), "--lora", str(args.lora)]  # fmt: skip
    if world == 1:
        argv = [sys.executable, __file__, *flags]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                __file__, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // world))}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def table(one: dict[str, Any], two: dict[str, Any], args: argparse.Namespace) -> str:
    mode = f"LoRA r={args.lora}" if args.lora else "full weights"
    return "\n".join([
        f"# FSDP2 (torch backend): 1 process vs 2 gloo ranks, SmolLM2-135M, CPU, float32, {mode}",
        "",
        f"`python bench/bench_fsdp2.py --batch {args.batch} --seq {args.seq} --steps {args.steps} "
        f"--lora {args.lora} --threads {args.threads}`: one GRPO train_step of a synthetic group "
        f"({args.batch} x {args.seq} tokens); {args.threads} threads in all ({args.threads} for 1 "
        f"process, {max(1, args.threads // 2)} per rank for 2).",
        "",
        "| world | step (s, median) | peak RSS per rank (GB) | loss | grad norm |",
        "|---|---|---|---|---|",
        f"| 1 | {one['step_s']:.2f} | {one['rss_gb'][0]:.2f} | {one['loss']:.6g} | {one['grad_norm']:.6g} |",
        f"| 2 | {two['step_s']:.2f} | {' / '.join(f'{r:.2f}' for r in two['rss_gb'])} | {two['loss']:.6g} "
        f"| {two['grad_norm']:.6g} |",
        "",
        f"Step time 2 ranks / 1 process: {two['step_s'] / one['step_s']:.2f}x; peak RSS of the larger "
        f"rank / 1 process: {max(two['rss_gb']) / one['rss_gb'][0]:.2f}x.",
        "",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank; 0 = full weights")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--result", default="")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as d:
        one = run(1, args, Path(d) / "one.json")
        two = run(2, args, Path(d) / "two.json")
    text = table(one, two, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
