"""Tiny models, batches and the torchrun harness shared by the megatron backend's tests.

`tiny_model(path, kind)` saves a 2-layer Llama/Qwen2/Qwen3 over a 96-token vocabulary with its norms
and biases perturbed (so a conversion test sees every tensor); `groups(seed)` builds two GRPO groups
of random trajectories. `run_torchrun(out, nproc, *args)` starts a gloo world of CPU processes on a
worker script (by default test_megatron_pp.py's `__main__`) and returns the metrics rank 0 wrote;
`assert_same_run` compares two such runs (losses, exported and gathered weights).

The workers import this module when torchrun runs a test file as a script: they put the repository
root on sys.path first, so `tests.megatron_support` resolves there as under pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_env.types import Episode
from tests.trainer_support import random_groups

__all__ = [
    "PP_WORKER",
    "assert_same_run",
    "groups",
    "odd_groups",
    "run_torchrun",
    "tiny_model",
    "train_and_record",
]

PP_WORKER = Path(__file__).with_name("test_megatron_pp.py")  # its __main__: one worker rank


def tiny_model(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg: transformers.PretrainedConfig
    cls: Any  # the model class of cfg (each takes only its own config type)
    common: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=kind == "llama",
    )  # fmt: skip
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(head_dim=8, **common), transformers.Qwen3ForCausalLM
    model = cls(cfg)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so the test sees every tensor
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def groups(seed: int = 0, vocab: int = 96) -> list[list[Episode]]:
    """Two GRPO groups of three random trajectories each (trainer_support.random_groups)."""
    return random_groups([[1.0, 0.0, 0.5]] * 2, seed, vocab)


def odd_groups(seed: int = 0, vocab: int = 96) -> list[list[Episode]]:
    """Groups of 3 and 2 episodes, 5 samples of 13 to 19 tokens: 3 microbatches under a budget of 40
    padded tokens, so two data-parallel ranks run 2 and 1 (+ a filler)."""
    return random_groups([[1.0, 0.0, 0.3], [0.0, 1.0]], seed, vocab, stagger=True)


def run_torchrun(out: Path, nproc: int, *args: str, script: str = str(PP_WORKER)) -> list[dict[str, float]]:
    """`torchrun --nproc_per_node nproc script out *args` (niced); the metrics rank 0 wrote."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29500 + os.getpid() % 400 + nproc), script, str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())  # type: ignore[no-any-return]


def assert_same_run(
    one: Path, two: Path, m1: list[dict[str, float]], m2: list[dict[str, float]], lr: float
) -> None:
    """Same loss and grad norm on step 1, same exported weights after it, same loss on step 2."""
    import torch
    from safetensors.torch import load_file

    for key in (
        "loss",
        "pg_loss",
        "kl",
        "clip_frac",
        "tis_mean",
        "tokens",
        "loss_tokens",
        "logprob_diff_mean",
    ):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-7), key
    assert m2[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-5)
    assert m2[1]["loss"] == pytest.approx(m1[1]["loss"], rel=1e-3, abs=1e-6)
    assert m2[1]["logprobs_len"] == m1[1]["logprobs_len"]
    for m in (m1, m2):
        assert m[1]["resumed_loss"] == m[1]["loss"] and m[1]["resumed_max_diff"] == 0.0
    assert m2[1]["logprobs_sum"] == pytest.approx(m1[1]["logprobs_sum"], rel=1e-4)
    a, b = (
        load_file(str(one / "export" / "model.safetensors")),
        load_file(str(two / "export" / "model.safetensors")),
    )
    assert set(a) == set(b)
    for k in a:  # Adam's first step is ~lr * sign(grad): only elements with a ~0 grad may differ
        agree = torch.isclose(a[k], b[k], rtol=0, atol=lr * 1e-3).float().mean()
        assert agree > 0.999, (k, float(agree))
        assert (a[k] - b[k]).abs().max() <= 2.5 * lr, k
    sa, sb = torch.load(one / "state.pt"), torch.load(two / "state.pt")
    assert set(sa) == set(sb)  # after step 2, gathered from both stages
    for k in sa:
        assert (sa[k] - sb[k]).abs().max() <= 5 * lr, k


def train_and_record(
    out: Path,
    model_dir: Path,
    pp: int,
    kl: float,
    dist_opt: bool = False,
    tp: int = 1,
    ep: int = 1,
    odd: bool = False,
    cp: int = 1,
) -> None:
    """One rank of a run (or a whole single-process run, in this process): 2 steps with an export and
    a checkpoint after the first, logprobs, a resumed trainer's second step; rank 0 writes
    metrics.json and state.pt (the gathered weights after step 2) into `out`."""
    from miles_env.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    out.mkdir(parents=True, exist_ok=True)

    cfg = MegatronTrainerConfig(tp=tp, pp=pp, ep=ep, cp=cp, lr=1e-3, fused_adamw=False, kl_coef=kl, max_tokens_per_microbatch=40,
                                distributed_optimizer=dist_opt)  # fmt: skip
    batch = odd_groups if odd else groups
    trainer = MegatronTrainer(model_dir, cfg)
    m1 = trainer.train_step(batch())
    trainer.export_weights(out / "export")
    trainer.save_checkpoint(out / "ckpt")  # one dir per (tp, pp) rank, written by dp rank 0
    m2 = trainer.train_step(batch(seed=1))
    samples = [e.samples[0] for g in batch(seed=2) for e in g]
    logps = trainer.logprobs(samples)  # forward-only through the pipeline, on every rank
    m2["logprobs_sum"] = float(sum(t.double().sum() for t in logps))
    m2["logprobs_len"] = float(sum(t.numel() for t in logps))
    m2["adam_numel"] = float(_adam_state_numel(trainer.optimizer))
    state = trainer.state_dict()  # collective: every rank gathers
    # a resumed trainer (weights and Adam state, sharded or not) takes the very same second step
    resumed = MegatronTrainer(model_dir, cfg)
    resumed.load_checkpoint(out / "ckpt")
    m2["resumed_loss"] = resumed.train_step(batch(seed=1))["loss"]
    again = resumed.state_dict()
    m2["resumed_max_diff"] = max(float((again[k] - v).abs().max()) for k, v in state.items())
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(state, out / "state.pt")
        (out / "metrics.json").write_text(json.dumps([m1, m2]))


def _adam_state_numel(optimizer: Any) -> int:
    """Elements of AdamW's first moment held by this rank (megatron's optimizers wrap torch's)."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        base = getattr(opt, "optimizer", opt)
        total += sum(s["exp_avg"].numel() for s in base.state.values() if "exp_avg" in s)
    return total
