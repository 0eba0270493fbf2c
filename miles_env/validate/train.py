"""The gate's last stage: a 2-step GRPO run on SmolLM2 through the real job.

Concept: write a small run config (the embedded `hf` engine on SmolLM2-135M-Instruct, the
builtin harness, 1 group of 2 rollouts per step, 2 steps, no eval) and run
`miles-env train` on it in a child process (its memory goes back when it ends; its output
goes to `train.log` in the run directory, never to an unread pipe). It passes when the
child exits 0, metrics.jsonl holds 2 train steps with finite losses and the resolved
config records the environment's distribution.

An environment without a `train` split trains on all its tasks: adapter names get
`?split=train`, which puts every task there.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from miles_env.environment import Environment
from miles_env.validate.report import StageResult

__all__ = ["TRAIN_STEPS", "train_config", "train_stage"]

TRAIN_STEPS = 2


def _train_env_name(name: str, env: Environment) -> str | None:
    from miles_env.adapters import is_adapter_name  # lazily: core never imports an adapter at load

    if "train" in env.splits and env.tasks("train"):
        return name
    if is_adapter_name(name) and "?split=" not in name:
        return f"{name}?split=train"
    return None


def train_config(env_name: str, run_dir: Path, provider: str, model: str) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir),
        "seed": 0,
        "mode": "sync",
        "env": env_name,
        "engine": {"kind": "hf", "model": model, "dtype": "float32"},
        "harness": {"name": "builtin", "max_turns": 1, "max_tokens": 16, "temperature": 1.0},
        "sandbox": {"provider": provider},
        "rollout": {"group_size": 2, "groups_per_step": 1, "concurrency": 2, "episode_timeout_s": 300},
        "trainer": {"backend": "torch", "steps": TRAIN_STEPS, "lr": 1e-5, "skip_zero_advantage": False,
                    "max_tokens_per_microbatch": 1024, "keep_checkpoints": 1},
        "eval": {"enabled": False},
    }  # fmt: skip


def _check_run(run_dir: Path, rc: int) -> list[str]:
    log = run_dir / "train.log"
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.is_file() else []
        return [f"miles-env train exited {rc}; last lines of {log}:", *tail]
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.is_file() else []
    train = [r for r in rows if r.get("kind") == "train"]
    problems = []
    if len(train) != TRAIN_STEPS:
        problems.append(f"{metrics}: {len(train)} train steps, want {TRAIN_STEPS}")
    for r in train:
        loss = r.get("loss")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            problems.append(f"step {r.get('step')}: loss {loss!r} is not a finite number")
    resolved = (
        yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    )
    if not (resolved or {}).get("env_dist"):
        problems.append(f"{run_dir / 'config.yaml'}: no env_dist recorded")
    return problems


def train_stage(
    name: str, env: Environment, work_dir: Path, *, provider: str = "local", model: str = "smollm2",
    timeout_s: float = 1800.0,
) -> StageResult:  # fmt: skip
    """Run `miles-env train` for TRAIN_STEPS steps on `name` in `work_dir`; judge what it leaves."""
    t0 = time.monotonic()
    env_name = _train_env_name(name, env)
    if env_name is None:
        return StageResult("train", False, "no train split to train on", (f"splits: {list(env.splits)}",))
    run_dir = work_dir / "train-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = work_dir / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(train_config(env_name, run_dir, provider, model), sort_keys=False))
    cmd = [sys.executable, "-m", "miles_env.cli.main", "train", str(cfg_path)]
    with (run_dir / "train.log").open("wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    problems = _check_run(run_dir, rc)
    summary = f"{TRAIN_STEPS}-step GRPO on {model} ({env_name}) in {run_dir}"
    return StageResult("train", not problems, summary, tuple(problems), duration_s=time.monotonic() - t0)
