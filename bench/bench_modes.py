"""fully_async vs sync throughput of `miles-env train` on the default CPU run, in one run.

Runs the same config (examples/terminal-cpu.yaml, eval off) for a few steps in each mode, one
after the other, and compares trained episodes per minute of wall time (from the first step's
start to the last step's end, read from metrics.jsonl) and episodes produced per minute (all
episodes that reached the queue). Usage: python bench/bench_modes.py [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, steps: int, out: Path, extra: list[str]) -> dict[str, float]:
    run_dir = out / mode
    args = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
    sets = [f"run_dir={run_dir}", f"mode={mode}", f"trainer.steps={steps}", "eval.enabled=false", *extra]
    for s in sets:
        args += ["--set", s]
    t0 = time.time()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in rows if r["kind"] == "train"]
    from miles_env.queue.sqlite import SqliteReplayQueue

    stats = SqliteReplayQueue(run_dir / "queue.db").stats()
    produced = sum(stats.episodes.values())
    trained = sum(r["episodes"] for r in train)
    return {
        "wall_s": wall,
        "trained": trained,
        "produced": produced,
        "trained_per_min": trained / (wall / 60),
        "produced_per_min": produced / (wall / 60),
        "reward_mean": sum(r["reward_mean"] for r in train) / len(train),
        "staleness_mean": sum(r["staleness_mean"] for r in train) / len(train),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-modes"))
    ap.add_argument("--set", dest="extra", action="append", default=[])
    a = ap.parse_args()
    results = {mode: run(mode, a.steps, a.out, a.extra) for mode in ("sync", "fully_async")}
    print(
        f"{'mode':<12} {'wall s':>8} {'trained':>8} {'produced':>9} {'trained/min':>12} {'produced/min':>13} {'staleness':>10}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<12} {r['wall_s']:8.0f} {r['trained']:8.0f} {r['produced']:9.0f} {r['trained_per_min']:12.1f} "
            f"{r['produced_per_min']:13.1f} {r['staleness_mean']:10.2f}"
        )
    s, f = results["sync"], results["fully_async"]
    print(
        f"fully_async / sync: trained episodes per minute {f['trained_per_min'] / s['trained_per_min']:.2f}x, "
        f"produced {f['produced_per_min'] / s['produced_per_min']:.2f}x (target >= 1.3x)"
    )


if __name__ == "__main__":
    main()
