"""What trains is what the policy did, under injected infrastructure failure: its cost and its curve.

Each rate is one real `miles-env train` run of examples/terminal-cpu.yaml (SmolLM2, hf engine, TITO
proxy, bubblewrap sandboxes, sqlite queue, torch trainer), the same seed and settings, with
`faults.sandbox_create` at 0 (the clean baseline, measured in the same invocation), 5% and 20%:
a failing creation costs a real create + close (miles_env/faults.py), its episode is
`sandbox_start`, never trains, and the job rolls it out again (rollout.run_valid_group). Eval
episodes are never faulted, so the eval curves compare the policies. Read from metrics.jsonl:
- trained episodes per minute: episodes that trained / the loop's wall time (rollout + wait +
  train + checkpoint + sync, evals excluded), and its ratio to the clean run's;
- wasted rollout share: the episodes' own seconds spent on episodes that never train (failed,
  or in a dropped group) over all their seconds;
- re-rolled episodes and dropped groups; the infrastructure share of every episode rolled out;
- the learning curves: the train pass rate per step (`pass_rate_policy`: over the episodes that
  ended by the policy) and the eval pass rate at each eval step.

Run: python bench/bench_learning_signal.py [--rates 0,0.05,0.2] [--steps 6] [--eval-every 3]
     [--keep DIR] [--out bench/results/learning_signal.md]
Re-read kept runs without running again (in the order they ran; the clean runs' mean is the
baseline): python bench/bench_learning_signal.py --summarise DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOOP_PARTS = ("rollout_s", "rollout_wait_s", "train_s", "checkpoint_s", "sync_s")


def run_rate(rate: float, args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], float]:
    run_dir = work / f"rate-{rate:g}"
    n = 1
    while run_dir.exists():  # a rate run again (a second clean baseline, to bracket the load's drift)
        n += 1
        run_dir = work / f"rate-{rate:g}-{n}"
    sets = [
        f"run_dir={run_dir}", f"seed={args.seed}", f"trainer.steps={args.steps}",
        f"rollout.groups_per_step={args.groups}", f"eval.every={args.eval_every}",
        f"eval.rollouts={args.eval_rollouts}", "trainer.keep_checkpoints=1",
        f"faults.sandbox_create={rate}", f"faults.seed={args.seed}",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
    for s in sets:
        cmd += ["--set", s]
    log = work / f"{run_dir.name}.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"rate {rate}: exit {proc.returncode}, see {log}:\n{log.read_text()[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line], wall


def summarise(rate: float, found: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    train = [r for r in found if r["kind"] == "train"]
    evals = [
        (int(r["step"]), float(r["pass_rate"])) for r in found if r["kind"] == "eval" and "pass_rate" in r
    ]
    loop_s = sum(float(r.get(k) or 0.0) for r in train for k in LOOP_PARTS)
    seconds = sum(float(r.get("rollout_episode_s") or 0.0) for r in train)
    wasted = sum(
        float(r.get("rollout_episode_s") or 0.0) * float(r.get("wasted_rollout_share") or 0.0) for r in train
    )
    infra = [
        1.0 - sum(float(r.get(f"ends/{e}") or 0.0) for e in ("completed", "truncated", "policy_format"))
        for r in train
    ]
    return {
        "rate": rate,
        "wall_s": wall,
        "trained": sum(float(r.get("trained_episodes") or 0.0) for r in train),
        "per_min": sum(float(r.get("trained_episodes") or 0.0) for r in train) / (loop_s / 60)
        if loop_s
        else 0.0,
        "wasted": wasted / seconds if seconds else 0.0,
        "rerolled": sum(float(r.get("episodes_rerolled") or 0.0) for r in train),
        "dropped": sum(float(r.get("groups_dropped_invalid") or 0.0) for r in train),
        "infra": sum(infra) / len(infra) if infra else 0.0,
        "train_pass": [round(float(r.get("pass_rate_policy", r.get("pass_rate")) or 0.0), 3) for r in train],
        "eval": evals,
    }


def table(rows: list[dict[str, Any]]) -> str:
    clean = [r["per_min"] for r in rows if r["rate"] == 0]
    base = sum(clean) / len(clean) if clean else None  # the clean runs' mean (several: the drift)
    out = [
        "| injected sandbox failure | infra share of episodes | trained episodes | trained / min | vs clean | "
        "wasted rollout share | re-rolled | groups dropped | run wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['per_min'] / base:.2f}x" if base else "-"
        out.append(
            f"| {100 * r['rate']:.0f}% | {100 * r['infra']:.1f}% | {r['trained']:.0f} | {r['per_min']:.1f} | "
            f"{ratio} | {100 * r['wasted']:.2f}% | {r['rerolled']:.0f} | {r['dropped']:.0f} | {r['wall_s']:.0f} |"
        )
    out += [
        "",
        "| injected sandbox failure | train pass rate per step | eval pass rate (step: rate) |",
        "|---|---|---|",
    ]
    for r in rows:
        ev = ", ".join(f"{s}: {p:.3f}" for s, p in r["eval"]) or "-"
        out.append(f"| {100 * r['rate']:.0f}% | {', '.join(map(str, r['train_pass']))} | {ev} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0,0.05,0.2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--eval-rollouts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=6 * 3600)
    p.add_argument("--keep", type=Path, default=None, help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--summarise", type=Path, default=None, help="re-read the runs kept in this dir")
    args = p.parse_args()
    if args.summarise is not None:
        kept = sorted(args.summarise.glob("rate-*/summary.json"), key=lambda m: m.stat().st_mtime)
        _write(table([summarise(*_kept(m.parent)) for m in kept]), args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bench-signal-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for rate in (float(x) for x in args.rates.split(",")):
            found, wall = run_rate(rate, args, work)
            rows.append(summarise(rate, found, wall))
            print(table(rows), flush=True)
    _write(table(rows), args.out)


def _kept(run_dir: Path) -> tuple[float, list[dict[str, Any]], float]:
    """A kept run: its injected rate (from its resolved config), metrics and wall time."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rate = float((cfg.get("faults") or {}).get("sandbox_create") or 0.0)
    found = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    wall = float(json.loads((run_dir / "summary.json").read_text()).get("wall_s", 0.0))
    return rate, found, wall


def _write(text: str, out: Path | None) -> None:
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
