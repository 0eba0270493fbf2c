"""Mixture-of-experts on the megatron backend, CPU: a GRPO step at ep=1 (one process) against ep=2
(two gloo ranks, each holding half of every layer's experts), and the bytes a weight sync of one MoE
step moves (full, delta, and a LoRA adapter on the attention and the experts).

Each world runs in its own child (ep=2 under torchrun) on the same synthetic GRPO group
(bench_trainer.make_group), one warm-up train_step then `--steps` timed ones (median); each rank's
peak RSS (ru_maxrss) is gathered to rank 0. The ep=2 step must report the single process's loss and
grad norm: the table shows both. Sizes: the tiny MoE of the tests (`--size tiny`: hidden 32, 4
experts) or a larger random one (`--size small`: hidden 256, 8 experts of 512, 4 layers, vocab 4096).
Ratios only: the machine's cores are shared.

    python bench/bench_moe.py [--size tiny|small] [--batch 8] [--seq 128] [--steps 3] [--out bench/results/moe.md]
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
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "moe_intermediate_size": 512, "num_experts": 8, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096},
}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_trainer import make_group

    from miles_env.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = MegatronTrainerConfig(ep=ep, lr=1e-4, fused_adamw=False, max_tokens_per_microbatch=args.seq * 2)
    trainer = MegatronTrainer(args.model, cfg)
    groups = [make_group(args.batch, args.seq, trainer.shape.vocab)]
    trainer.train_step(groups)  # warm-up
    times, metrics = [], {}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rss_all = [rss] * ep
    if ep > 1:
        dist.all_gather_object(rss_all, rss)
    if dist.get_rank() == 0:
        keys = ("loss", "grad_norm", "moe_aux_loss", "moe_max_load")
        out = {"step_s": statistics.median(times), "rss_gb": rss_all} | {k: metrics[k] for k in keys}
        Path(args.result).write_text(json.dumps(out))
    if ep > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(world: int, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    flags = ["--child", "--model", str(args.model), "--result", str(result), "--batch", str(args.batch),
             "--seq", str(args.seq), "--steps", str(args.steps)]  # fmt: skip
    if world == 1:
        argv = [sys.executable, __file__, *flags]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                __file__, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // world))}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def sync_bytes(model: Path, args: argparse.Namespace) -> dict[str, float]:
    """One torch-backend step of the MoE, then what each sync kind would move to an engine."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_trainer import make_group

    from miles_env.trainer.config import LoraConfig, TrainerConfig
    from miles_env.trainer.torch_backend import TorchTrainer
    from miles_env.trainer.weight_delta import encode_delta
    from miles_env.trainer.weight_sync import WeightSyncer

    trainer = TorchTrainer(model, TrainerConfig(lr=1e-5, fused_adamw=False))
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    groups = [make_group(args.batch, args.seq, vocab)]
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.train_step(groups)
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        cast = WeightSyncer(dtype=dtype)._cast
        delta = encode_delta(cast(before), cast(trainer.state_dict()), 0, 1)
        name = str(dtype).removeprefix("torch.")
        out[f"full_{name}"], out[f"delta_{name}"] = float(delta.full_bytes), float(delta.nbytes)
    lora = LoraConfig(
        rank=8, alpha=16, target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    )
    adapted = TorchTrainer(model, TrainerConfig(lr=1e-4, fused_adamw=False, lora=lora))
    adapted.train_step(groups)
    with tempfile.TemporaryDirectory() as d:
        path = adapted.export_adapter(Path(d) / "a")
        out["lora_adapter"] = float((path / "adapter_model.safetensors").stat().st_size)
    return out


def table(one: dict[str, Any], two: dict[str, Any], sync: dict[str, float], args: argparse.Namespace) -> str:
    size = SIZES[args.size] or {"hidden_size": 32, "num_experts": 4, "num_hidden_layers": 2}
    desc = ", ".join(f"{k}={v}" for k, v in size.items())
    return "\n".join([
        f"# MoE on the megatron backend: ep=1 vs ep=2 (gloo, CPU), a random Qwen3-MoE (`--size {args.size}`: {desc})",
        "",
        f"`python bench/bench_moe.py --size {args.size} --batch {args.batch} --seq {args.seq} --steps {args.steps} "
        f"--threads {args.threads}`: one GRPO train_step of a synthetic group ({args.batch} x {args.seq} tokens), "
        f"all-gather token dispatch; {args.threads} thread(s) for ep=1, {max(1, args.threads // 2)} per rank for ep=2.",
        "",
        "| ep | step (s, median) | peak RSS per rank (GB) | loss | grad norm | aux loss | max expert load |",
        "|---|---|---|---|---|---|---|",
        f"| 1 | {one['step_s']:.3f} | {one['rss_gb'][0]:.2f} | {one['loss']:.6g} | {one['grad_norm']:.6g} "
        f"| {one['moe_aux_loss']:.4f} | {one['moe_max_load']:.3f} |",
        f"| 2 | {two['step_s']:.3f} | {' / '.join(f'{r:.2f}' for r in two['rss_gb'])} | {two['loss']:.6g} "
        f"| {two['grad_norm']:.6g} | {two['moe_aux_loss']:.4f} | {two['moe_max_load']:.3f} |",
        "",
        f"Step time ep=2 / ep=1: {two['step_s'] / one['step_s']:.2f}x; peak RSS of the larger rank / ep=1: "
        f"{max(two['rss_gb']) / one['rss_gb'][0]:.2f}x.",
        "",
        "Weight sync of one MoE step (torch backend, lr 1e-5; bytes an engine receives):",
        "",
        "| sync | float32 engine | bfloat16 engine |",
        "|---|---|---|",
        f"| full | {sync['full_float32']:,.0f} | {sync['full_bfloat16']:,.0f} |",
        f"| delta | {sync['delta_float32']:,.0f} ({sync['delta_float32'] / sync['full_float32']:.1%}) "
        f"| {sync['delta_bfloat16']:,.0f} ({sync['delta_bfloat16'] / sync['full_bfloat16']:.1%}) |",
        f"| LoRA r=8 adapter (attention + experts) | {sync['lora_adapter']:,.0f} "
        f"({sync['lora_adapter'] / sync['full_float32']:.1%}) | |",
        "",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--result", default="")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from miles_env.models import make_tiny_moe

    with tempfile.TemporaryDirectory() as d:
        args.model = make_tiny_moe(Path(d) / "moe", tokenizer=None, **SIZES[args.size])
        one = run(1, args, Path(d) / "one.json")
        two = run(2, args, Path(d) / "two.json")
        sync = sync_bytes(args.model, args)
    text = table(one, two, sync, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
