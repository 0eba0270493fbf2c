"""The learning bar: how soon the default run's held-out eval pass rate reaches a target, per seed.

Each seed is one real `miles-env train` run of a config (default: examples/terminal-cpu.yaml,
what `./scripts/run.sh` runs: SmolLM2, hf engine, TITO proxy, bubblewrap sandboxes, sqlite
queue, torch trainer), with an eval every `--eval-every` steps. The clock starts when the process
is launched (model load, the step-0 eval and every later eval are inside it), as a user's
`./scripts/run.sh` would see it after setup. Per seed the table gives the eval curve (step,
minutes, pass rate), the first eval at or above the target and its minute, and the train reward per
step. The run is stopped once the budget is spent (the eval that crosses it still counts, at its
real minute, so a late crossing is reported as a miss, not hidden).

Run: python bench/bench_learning_bar.py [--config examples/terminal-cpu.yaml] [--seeds 0,1]
     [--steps 30] [--eval-every 5] [--target 0.8] [--budget-min 30] [--stop-at-target]
     [--set KEY=VALUE ...]
     [--keep DIR] [--out bench/results/learning_bar.md]
Re-read kept runs: python bench/bench_learning_bar.py --summarise DIR [--target 0.8] [--budget-min 30]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, args: argparse.Namespace, work: Path) -> Path:
    """Train one seed into work/seed-S; stopped once an eval has ended past the budget."""
    run_dir = work / f"seed-{seed}"
    cmd = [sys.executable, "-m", "miles_env.cli.main", "train", str(args.config)]
    for s in [f"run_dir={run_dir}", f"seed={seed}", f"trainer.steps={args.steps}",
              f"eval.every={args.eval_every}", *args.set]:  # fmt: skip
        cmd += ["--set", s]
    log = work / f"seed-{seed}.log"
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(5)
                if _done(run_dir, start, args):
                    proc.send_signal(signal.SIGINT)  # what it measured is in metrics.jsonl already
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        finally:
            if proc.poll() is None:
                proc.kill()
    (run_dir / "bar.json").write_text(json.dumps({"start": start, "cmd": cmd, "rc": proc.returncode}))
    return run_dir


def _done(run_dir: Path, start: float, args: argparse.Namespace) -> bool:
    """True once an eval ended after the budget (so a late crossing is recorded as late), or,
    with --stop-at-target, once an eval reached the target."""
    evals = [r for r in _records(run_dir) if r["kind"] == "eval"]
    if not evals:
        return False
    hit = args.stop_at_target and any(float(r.get("pass_rate") or 0.0) >= args.target for r in evals)
    return hit or evals[-1]["time"] - start > 60 * args.budget_min


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(run_dir: Path, target: float, budget_min: float) -> dict[str, Any]:
    meta = json.loads((run_dir / "bar.json").read_text())
    found = _records(run_dir)
    evals = [(int(r["step"]), (r["time"] - meta["start"]) / 60, float(r["pass_rate"]))
             for r in found if r["kind"] == "eval" and "pass_rate" in r]  # fmt: skip
    train = [float(r.get("reward_mean") or 0.0) for r in found if r["kind"] == "train"]
    hit = next(((s, m, p) for s, m, p in evals if p >= target), None)
    return {
        "seed": run_dir.name.removeprefix("seed-"),
        "evals": evals,
        "train": train,
        "hit": hit,
        "ok": hit is not None and hit[1] <= budget_min,
        "lr": next((r.get("lr") for r in found if r["kind"] == "train"), None),
    }


def table(rows: list[dict[str, Any]], target: float, budget_min: float) -> str:
    out = [
        f"| seed | first eval >= {target:g} (step, minute) | within {budget_min:g} min | "
        "eval curve (step @ minute: pass rate) | train reward per step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        hit = f"step {r['hit'][0]}, {r['hit'][1]:.1f} min ({r['hit'][2]:.3f})" if r["hit"] else "never"
        curve = ", ".join(f"{s} @ {m:.1f}: {p:.3f}" for s, m, p in r["evals"])
        train = ", ".join(f"{x:.2f}" for x in r["train"])
        out.append(f"| {r['seed']} | {hit} | {'yes' if r['ok'] else 'no'} | {curve} | {train} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/terminal-cpu.yaml")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--budget-min", type=float, default=30.0)
    p.add_argument("--stop-at-target", action="store_true", help="stop a seed at its first eval >= target")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE, passed to every run")
    p.add_argument("--keep", type=Path, default=Path("/tmp/bench-learning-bar"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--summarise", type=Path, default=None, help="re-read the runs kept in this dir")
    args = p.parse_args()
    if args.summarise is not None:
        dirs = sorted(args.summarise.glob("seed-*/bar.json"))
        rows = [summarise(d.parent, args.target, args.budget_min) for d in dirs]
    else:
        args.keep.mkdir(parents=True, exist_ok=True)
        rows = []
        for seed in (int(x) for x in args.seeds.split(",")):
            rows.append(summarise(run_seed(seed, args, args.keep), args.target, args.budget_min))
            print(table(rows[-1:], args.target, args.budget_min), flush=True)
    text = table(rows, args.target, args.budget_min)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
