"""LoRA against full-weight training on SmolLM2: step time, peak RSS, and what a weight sync moves.

Each mode runs in its own child process (so its peak RSS is its own) on the same synthetic GRPO
group (bench_trainer.make_group: fixed token ids, half the episodes rewarded): `--steps` timed
train_steps after one warm-up, median reported. Sync bytes after the last step, float32 as the
trainer holds them: full (every base tensor), delta (trainer/weight_delta.encode_delta of the
weights before and after the step: what `weight_sync: delta` moves), and for LoRA the adapter
file (what `trainer.lora` moves) and the delta of the merged weights (what a merge-and-sync
design would move instead).

    python bench/bench_lora.py [--batch 4] [--seq 256] [--steps 3] [--rank 8] [--out bench/results/lora.md]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(mode: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_trainer import make_group

    from miles_env.trainer.config import LoraConfig, TrainerConfig
    from miles_env.trainer.lora import param_share
    from miles_env.trainer.torch_backend import TorchTrainer
    from miles_env.trainer.weight_delta import encode_delta

    torch.set_num_threads(args.threads)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank) if mode == "lora" else None
    trainer = TorchTrainer("smollm2", TrainerConfig(lr=1e-5, lora=lora))
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    groups = [make_group(args.batch, args.seq, vocab)]
    trainer.train_step(groups)  # warm-up
    times = []
    for _ in range(args.steps):
        before = {k: v.clone() for k, v in trainer.state_dict().items()} if _ == args.steps - 1 else None
        t0 = time.perf_counter()
        trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
    assert before is not None
    after = trainer.state_dict()
    names = {k: after[k] for k in before}
    out = {
        "step_s": statistics.median(times),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "full_bytes": float(trainer.full_weight_bytes()),
        "delta_bytes": float(encode_delta(before, names, 0, 1).nbytes),
    }
    if lora is not None:
        with tempfile.TemporaryDirectory() as d:
            path = trainer.export_adapter(Path(d) / "adapter")
            out["adapter_bytes"] = float((path / "adapter_model.safetensors").stat().st_size)
        out["param_share"] = param_share(trainer.model)
    return out


def table(res: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    full, lora = res["full"], res["lora"]
    mb = 2**20
    lines = [
        "# LoRA vs full-weight training (SmolLM2-135M, CPU, float32)",
        "",
        f"`python bench/bench_lora.py --batch {args.batch} --seq {args.seq} --steps {args.steps} "
        f"--rank {args.rank} --threads {args.threads}`; LoRA on q,k,v,o,gate,up,down_proj, alpha = 2 x rank.",
        "",
        "| mode | step (s, median) | peak RSS (GB) | sync bytes (MB) | full sync (MB) | delta sync (MB) |",
        "|---|---|---|---|---|---|",
        f"| full weights | {full['step_s']:.2f} | {full['peak_rss_gb']:.2f} | {full['delta_bytes'] / mb:.1f} "
        f"(delta) | {full['full_bytes'] / mb:.1f} | {full['delta_bytes'] / mb:.1f} |",
        f"| LoRA r={args.rank} | {lora['step_s']:.2f} | {lora['peak_rss_gb']:.2f} | "
        f"{lora['adapter_bytes'] / mb:.2f} (adapter) | {lora['full_bytes'] / mb:.1f} | "
        f"{lora['delta_bytes'] / mb:.1f} (merged weights) |",
        "",
        f"Adapter parameters / base parameters (`lora_param_share`): {lora['param_share']:.4%}. "
        f"Adapter sync / full sync: {lora['adapter_bytes'] / lora['full_bytes']:.4%}; "
        f"LoRA step time / full: {lora['step_s'] / full['step_s']:.2f}x; "
        f"peak RSS LoRA / full: {lora['peak_rss_gb'] / full['peak_rss_gb']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=["full", "lora"], default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    res = {}
    for mode in ("full", "lora"):
        argv = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        proc = subprocess.run(argv, capture_output=True, text=True, check=True)
        res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    text = table(res, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
