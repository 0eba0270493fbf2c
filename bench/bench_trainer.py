"""Trainer overhead: TorchTrainer.train_step against a bare torch loop on the same model and batches.

The bare loop is what any hand-written trainer does per step: forward, masked cross-entropy
weighted by the advantage, backward, grad clip, AdamW step (torch defaults). A second bare
loop uses the trainer's own kernels (logsumexp + gather logprobs, fused AdamW), which isolates
the cost of the trainer's bookkeeping (collation, TIS, clipping, metrics) from kernel choices. Steps alternate (bare, trainer,
bare, ...) so that load from other processes hits both alike. Target: overhead <= 10%.

    python bench/bench_trainer.py [--model smollm2] [--batch 4] [--seq 256] [--steps 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.losses import token_logprobs
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Episode, Reward, Status, Trajectory, Turn


def make_group(batch: int, seq: int, vocab: int) -> list[Episode]:
    rng = random.Random(0)
    prompt = seq // 4
    eps = []
    for i in range(batch):
        mask = [0] * prompt + [1] * (seq - prompt)
        traj = Trajectory(
            token_ids=[rng.randrange(vocab) for _ in range(seq)],
            loss_mask=mask,
            logprobs=[0.0 if m == 0 else -rng.random() * 5 for m in mask],
            turns=[Turn(start=prompt, prompt_len=prompt, completion_len=seq - prompt, finish_reason="stop")],
        )
        eps.append(Episode(id=f"e{i}", task_id="t", env="bench", group_id="g", status=Status.COMPLETED,
                           reward=Reward(score=float(i % 2)), samples=[traj]))  # fmt: skip
    return eps


def bare_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    kernel: str,
) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    m = mask[:, 1:]
    if kernel == "cross_entropy":
        lg = logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll.view_as(m) * m * adv[:, None]).sum() / m.sum()
    else:
        lp = token_logprobs(logits, ids)[:, 1:]
        loss = -(lp * m * adv[:, None]).sum() / m.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    tokens = args.batch * args.seq
    trainer = TorchTrainer(args.model, TrainerConfig(lr=1e-6, max_tokens_per_microbatch=tokens))
    vocab = trainer.model.config.vocab_size
    group = make_group(args.batch, args.seq, vocab)
    ids = torch.tensor([e.samples[0].token_ids for e in group])
    mask = torch.tensor([e.samples[0].loss_mask for e in group], dtype=torch.float32)
    adv = torch.tensor([1.0, -1.0] * (args.batch // 2) + [0.0] * (args.batch % 2))
    params = list(trainer.model.parameters())
    bare = {
        "bare torch (defaults)": ("cross_entropy", torch.optim.AdamW(params, lr=1e-6)),
        "bare torch (same kernels)": ("logsumexp", torch.optim.AdamW(params, lr=1e-6, fused=True)),
    }
    for kernel, opt in bare.values():  # warm-up every path
        bare_step(trainer.model, opt, ids, mask, adv, kernel)
    trainer.train_step([group])
    times: dict[str, list[float]] = {name: [] for name in [*bare, "TorchTrainer"]}
    for i in range(args.steps):
        for name, (kernel, opt) in bare.items():
            times[name].append(bare_step(trainer.model, opt, ids, mask, adv, kernel))
        times["TorchTrainer"].append(trainer.train_step([group])["step_time_s"])
        print(f"round {i}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"model {args.model}, {args.batch}x{args.seq} tokens/step, fp32, {torch.get_num_threads()} threads, "
          f"median of {args.steps} steps")  # fmt: skip
    base = med["bare torch (defaults)"]
    print(f"{'loop':28} {'s/step':>8} {'tokens/s':>9} {'ratio':>6}")
    for name, t in med.items():
        print(f"{name:28} {t:8.2f} {tokens / t:9.0f} {t / base:6.2f}")
    same = med["bare torch (same kernels)"]
    print(f"overhead vs bare defaults {100 * (med['TorchTrainer'] / base - 1):+.1f}%, "
          f"vs bare loop with the same kernel {100 * (med['TorchTrainer'] / same - 1):+.1f}%  (target <= +10%)")  # fmt: skip


if __name__ == "__main__":
    main()
