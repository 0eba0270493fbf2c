"""Dynamic sampling off vs on, on the default CPU run (`miles-env train`), in one run.

Runs examples/terminal-cpu.yaml (eval off, `--steps` steps) without and then with
`rollout.dynamic_sampling: true`, one after the other, same seed, and reads back from each run
directory: every group that reached the queue (decoded from queue.db) and whether it had signal
(`trainer.groups.has_signal`, the loop's own judgement), the groups each step trained, the
episodes rolled out (re-rolls included), the per-step train reward (over every group drawn), and
the wall time. Prints a row per variant and on / off ratios: groups with signal trained per step,
episodes rolled out per group with signal trained, wall time per step.
Only the first `--steps` steps of each run count; a variant whose run directory already has them
is read back, not run again (so the two halves can run at different times; say so when reporting). Usage:
    python bench/bench_dynamic_sampling.py [--steps 4] [--out DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from miles_env.queue.codec import decode_episode
from miles_env.trainer.groups import has_signal
from miles_env.types import POLICY_ENDS, Episode

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"off": [], "on": ["rollout.dynamic_sampling=true"]}


def _groups(run_dir: Path, steps: int) -> list[list[Episode]]:
    """The groups rolled out for the first `steps` steps (sync: step k samples at version k - 1)."""
    conn = sqlite3.connect(run_dir / "queue.db")
    by_group: dict[str, list[Episode]] = defaultdict(list)
    for meta, arrays in conn.execute("SELECT meta, arrays FROM episodes"):
        ep = decode_episode(meta, arrays)
        if ep.min_weight_version < steps:
            by_group[ep.group_id].append(ep)
    conn.close()
    return list(by_group.values())


def _train_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    return [r for r in rows if r["kind"] == "train"]


def run(name: str, steps: int, out: Path, extra: list[str]) -> dict[str, object]:
    run_dir = out / name
    if len(_train_rows(run_dir)) < steps:  # else read back (the run dir may hold more steps)
        args = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
        for s in [
            f"run_dir={run_dir}",
            f"trainer.steps={steps}",
            "eval.enabled=false",
            *VARIANTS[name],
            *extra,
        ]:
            args += ["--set", s]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    train = _train_rows(run_dir)[:steps]
    parts = ("rollout_s", "rollout_wait_s", "train_s", "checkpoint_s", "sync_s")
    wall = train[-1]["time"] - train[0]["time"] + sum(train[0].get(k, 0.0) for k in parts)
    groups = _groups(run_dir, steps)
    signal = sum(has_signal(g, POLICY_ENDS) for g in groups)
    size = max(len(g) for g in groups)
    trained = sum(r["trained_episodes"] for r in train) / size  # groups
    signal_trained = trained if name == "on" else signal  # off trains every group it rolled out
    rolled = sum(len(g) for g in groups) + sum(r.get("episodes_rerolled", 0.0) for r in train)
    return {
        "wall_s": wall,
        "groups_rolled": len(groups),
        "groups_with_signal": signal,
        "groups_trained": trained,
        "signal_per_step": signal_trained / len(train),
        "episodes_rolled": rolled,
        "rolled_per_signal_group": rolled / max(1e-9, signal_trained),
        "skipped_steps": sum(r.get("dynamic_sampling_skipped", 0.0) for r in train),
        "train_reward": [round(r["reward_mean"], 2) for r in train],
        "samples": [int(r["samples"]) for r in train],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-dynamic-sampling"))
    ap.add_argument("--set", dest="extra", action="append", default=[])
    a = ap.parse_args()
    res = {name: run(name, a.steps, a.out, a.extra) for name in VARIANTS}
    for name, r in res.items():
        print(
            f"{name}: "
            + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        )
    off, on = res["off"], res["on"]
    ratio = {
        k: float(on[k]) / max(1e-9, float(off[k])) for k in ("signal_per_step", "rolled_per_signal_group")
    }  # type: ignore[arg-type]
    wall = float(on["wall_s"]) / float(off["wall_s"])  # type: ignore[arg-type]
    print(
        f"on / off: groups with signal trained per step {ratio['signal_per_step']:.2f}x, episodes rolled "
        f"out per group with signal {ratio['rolled_per_signal_group']:.2f}x, wall per step {wall:.2f}x"
    )


if __name__ == "__main__":
    main()
