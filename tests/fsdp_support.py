"""The FSDP2 tests' fixed step, their torchrun worker and what they compare (tests/test_fsdp2.py).

`groups()` is one step's worth of GRPO groups (3 + 2 episodes: an odd number of samples, so under
2 ranks one rank trains 3 and the other 2 plus a zero-weight filler); `lone_group()` trains one sample; `trainer(model, lora)` builds
the TorchTrainer every run uses (a microbatch budget that packs each sample alone); `steps(...)`
trains and records. Run as a script under torchrun (`run_torchrun`), this module is one rank of the
2-rank side: it trains 2 steps (checkpointing after the first) and a lone-sample step, and then resumes a checkpoint the
single process wrote and takes its next step; rank 0 writes metrics, weights and exports to `out`.

Under torchrun this file runs as a script: it puts the repository root on sys.path first, so
`tests.*` resolves as under pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.ranks import leave
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Episode
from tests.trainer_support import random_groups

__all__ = ["METRICS", "WORKER", "groups", "lone_group", "run_torchrun", "save_run", "steps", "trainer"]

WORKER = Path(__file__)
VOCAB = 96
# what a 2-rank step must report as one process does (summed or maxed over ranks)
METRICS = (
    "loss", "pg_loss", "clip_frac", "tis_mean", "grad_norm", "samples", "tokens", "loss_tokens",
    "logprob_diff_mean", "logprob_diff_max", "reward_mean",
)  # fmt: skip


def groups(seed: int = 0) -> list[list[Episode]]:
    """Two groups (3 and 2 episodes) of random trajectories: 5 samples, 13 to 19 tokens each."""
    return random_groups([[1.0, 0.0, 0.5], [0.0, 1.0]], seed, VOCAB, stagger=True)


def lone_group() -> list[list[Episode]]:
    """A group whose second episode has no sampled token: one sample, so under 2 ranks one rank has
    no microbatch of its own and runs only the zero-weight filler."""
    (a, b, _), _ = groups(7)
    masked = b.samples[0].model_copy(update={"loss_mask": [0] * len(b.samples[0].token_ids),
                                             "logprobs": [0.0] * len(b.samples[0].token_ids)})  # fmt: skip
    return [[a, b.model_copy(update={"samples": [masked]})]]


EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # a MoE's fused expert tensors


def trainer(model: Path, lora: int) -> TorchTrainer:
    """A float32 trainer whose microbatches hold one sample each (two 13-token rows exceed 24);
    lora 1: LoRA on the linears, 2: also on a MoE's experts (PEFT target_parameters)."""
    params = EXPERTS if lora == 2 else ()
    cfg = TrainerConfig(
        lr=1e-3, max_tokens_per_microbatch=24,
        lora=LoraConfig(rank=4, alpha=8, target_parameters=params) if lora else None,
    )  # fmt: skip
    return TorchTrainer(model, cfg)


def steps(t: TorchTrainer, n: int, ckpt: Path | None = None) -> list[dict[str, float]]:
    """`n` steps on `groups(step)`; a checkpoint into `ckpt` after the first."""
    out = []
    for _ in range(n):
        out.append(t.train_step(groups(t.step)))
        if ckpt is not None and t.step == 1:
            t.save_checkpoint(ckpt, {"step": t.step})
    return out


def save_run(t: TorchTrainer, out: Path, metrics: list[dict[str, float]]) -> None:
    """Metrics, full (merged) weights, the logprobs of step 0's samples and the adapter; every rank
    enters (each call is collective when sharded), rank 0 writes."""
    state = t.state_dict()
    logprobs = t.logprobs([traj for g in groups(0) for ep in g for traj in ep.samples])
    if t.lora is not None:
        t.export_adapter(out / "adapter")
    if t.world.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "state.pt")
        torch.save(logprobs, out / "logprobs.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))


def run_torchrun(out: Path, nproc: int, *args: str) -> None:
    """`torchrun --nproc_per_node nproc WORKER out *args`; its output goes to out/torchrun.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(out), *args]  # fmt: skip
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=600, env=_env())
    assert proc.returncode == 0, log.read_text()[-4000:]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}


def _main(out: Path, model: Path, lora: int, resume_from: Path) -> None:
    """2 fresh steps (checkpoint after the first) -> out/fresh; then `resume_from`'s checkpoint,
    one step -> out/resumed."""
    t = trainer(model, lora)
    save_run(t, out / "fresh", steps(t, 2, out / "ckpt"))
    save_run(t, out / "lone", [t.train_step(lone_group())])
    r = trainer(model, lora)
    extra: Any = r.load_checkpoint(resume_from)
    assert extra == {"step": 1}, extra
    save_run(r, out / "resumed", steps(r, 1))
    del t, r
    leave()  # the sharded models freed now, not at interpreter exit (trainer/ranks.py)


if __name__ == "__main__":
    _main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
