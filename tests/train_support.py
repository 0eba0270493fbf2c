"""Driving `miles-env train` as a subprocess and reading the run directory it leaves, for the
end-to-end tests (test_train_e2e, the megatron and cluster runs).

`train_args(run_dir, model, steps, *sets)` is the command line of a short run of
examples/terminal-cpu.yaml (2 groups of 2 per step, 1 turn of 8 tokens, every checkpoint kept);
`rows(run_dir, kind)` reads metrics.jsonl; `trained_ids(run_dir)` is the lineage of the newest
checkpoint's model, read from every checkpoint's `trained_episode_ids`. The tiny model they run is
the `tiny_model` fixture of conftest.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["ROOT", "rows", "train_args", "trained_ids"]

ROOT = Path(__file__).resolve().parents[1]


def train_args(run_dir: Path, model: Path, steps: int, *extra: str) -> list[str]:
    sets = [
        f"run_dir={run_dir}", f"engine.model={model}", f"trainer.steps={steps}", "rollout.group_size=2",
        "rollout.groups_per_step=2", "rollout.concurrency=4", "harness.max_tokens=8", "harness.max_turns=1",
        "eval.rollouts=1", "eval.tiers=[1]", "trainer.lr=1e-3", "trainer.skip_zero_advantage=false",
        "trainer.keep_checkpoints=100", *extra,
    ]  # fmt: skip
    out = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
    for s in sets:
        out += ["--set", s]
    return out


def rows(run_dir: Path, kind: str) -> list[dict]:
    found = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in found if r["kind"] == kind]


def trained_ids(run_dir: Path) -> list[str]:
    """The episode ids the newest checkpoint's model trained on, in order: each checkpoint holds
    those trained since the previous one (the loop resumes from the newest, so none is stale)."""
    ids: list[str] = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        ids += json.loads((ckpt / "trainer.json").read_text())["extra"]["trained_episode_ids"]
    return ids
