"""On-policy distillation (`algorithm: opd`): what the teacher adds to a step, and whether it teaches.

Each mode is one real `miles-env train` run of examples/terminal-cpu.yaml (hf engine, TITO proxy,
bubblewrap sandboxes, sqlite queue, torch trainer) with the same seed and settings:
- grpo: the baseline, task reward only (every sample trained, as OPD trains every sample, so the
  steps differ by the teacher only);
- opd: pure distillation (kl_weight 1, reward_weight 0) from the teacher;
- opd+reward: the teacher's signal plus the GRPO advantage (reward_weight 1).
The teacher is an hf engine on `--teacher` (an HF model dir or a name miles_env.models knows), or,
with `--teacher-run RUN_DIR`, the newest checkpoint of an earlier run (the default RL run) exported
to an HF dir first. Read from metrics.jsonl per step: the step's wall time (rollout + train +
checkpoint + weight sync), `opd/teacher_s` and `opd/teacher_share` (the teacher's seconds over
that), `opd/reverse_kl` (mean over sampled tokens of student - teacher logprob); from the eval
rows, the pass rate before and after. With an RL-trained teacher the reverse KL should fall over
the steps and the eval pass rate rise (the long run; minutes per step on 2 CPU cores).

Run: python bench/bench_opd.py [--teacher-run runs/terminal-cpu] [--steps 10] [--out bench/results/opd.md]
Quick (cost only, the student as its own teacher): python bench/bench_opd.py --steps 2 --no-eval
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES: dict[str, list[str]] = {
    "grpo": [],
    "opd": ["algorithm=opd", "opd.kl_weight=1.0", "opd.reward_weight=0.0"],
    "opd+reward": ["algorithm=opd", "opd.kl_weight=1.0", "opd.reward_weight=1.0"],
}
STEP_PARTS = ("rollout_s", "rollout_wait_s", "train_s", "checkpoint_s", "sync_s")


def export_teacher(run_dir: Path, base_model: str, out: Path) -> Path:
    """The newest checkpoint of `run_dir` as an HF model dir (weights + config + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_env.models import resolve_model
    from miles_env.trainer.checkpoint import latest_checkpoint, read_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"{run_dir}/checkpoints: no checkpoint to distill from")
    state, meta = read_checkpoint(ckpt)
    base = resolve_model(base_model)
    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.load_state_dict(state["model"])
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    print(f"teacher: {ckpt} (step {meta['step']}) -> {out}", flush=True)
    return out


def run_mode(name: str, args: argparse.Namespace, teacher: str, work: Path) -> list[dict[str, Any]]:
    run_dir = work / name
    sets = [
        f"run_dir={run_dir}", f"engine.model={args.model}", f"trainer.steps={args.steps}",
        f"rollout.group_size={args.group_size}", f"rollout.groups_per_step={args.groups}",
        f"rollout.concurrency={args.group_size * args.groups}", f"harness.max_tokens={args.max_tokens}",
        f"trainer.lr={args.lr}", f"eval.enabled={str(not args.no_eval).lower()}", "trainer.keep_checkpoints=1",
        f"eval.rollouts={args.eval_rollouts}", "opd.teacher.kind=hf", f"opd.teacher.model={teacher}",
        "opd.teacher.dtype=float32", "trainer.skip_zero_advantage=false", *MODES[name],
    ]  # fmt: skip
    if name == "grpo":
        sets = [s for s in sets if not s.startswith("opd.")]
    cmd = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
    for s in sets:
        cmd += ["--set", s]
    log = work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}, see {log}:\n{log.read_text()[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def summarise(name: str, found: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in found if r["kind"] == "train"]
    evals = {r["step"]: r for r in found if r["kind"] == "eval" and "pass_rate" in r}
    step_s = [sum(float(r.get(k) or 0.0) for k in STEP_PARTS) for r in train]
    teacher = [float(r.get("opd/teacher_s") or 0.0) for r in train]
    kl = [r.get("opd/reverse_kl") for r in train]
    first, last = (evals[min(evals)], evals[max(evals)]) if evals else (None, None)
    return {
        "mode": name,
        "steps": len(train),
        "step_s": statistics.median(step_s) if step_s else float("nan"),
        "teacher_s": statistics.median(teacher) if teacher else 0.0,
        "share": statistics.median(t / s for t, s in zip(teacher, step_s, strict=True) if s > 0)
        if train
        else 0,
        "kl": kl,
        "reward": [round(float(r.get("reward_mean") or 0.0), 3) for r in train],
        "eval": None if first is None or last is None else (first["pass_rate"], last["pass_rate"]),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = "| mode | steps | step s (median) | teacher s | teacher share | reverse KL per step | reward per step | eval pass before -> after |"
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = ", ".join("-" if v is None else f"{v:.3f}" for v in r["kl"]) if r["mode"] != "grpo" else "-"
        ev = "-" if r["eval"] is None else f"{r['eval'][0]:.3f} -> {r['eval'][1]:.3f}"
        share = f"{100 * r['share']:.1f}%" if r["mode"] != "grpo" else "-"
        out.append(
            f"| {r['mode']} | {r['steps']} | {r['step_s']:.1f} | {r['teacher_s']:.2f} | {share} | {kl} | "
            f"{', '.join(map(str, r['reward']))} | {ev} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--teacher", default=None, help="HF dir or model name (default: --model itself)")
    p.add_argument("--teacher-run", type=Path, default=None, help="distill from this run's newest checkpoint")
    p.add_argument("--modes", default="grpo,opd,opd+reward")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--eval-rollouts", type=int, default=2)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--timeout-s", type=float, default=6 * 3600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-opd-") as tmp:
        work = Path(tmp)
        teacher = args.teacher or args.model
        if args.teacher_run is not None:
            teacher = str(export_teacher(args.teacher_run, args.model, work / "teacher"))
        rows = []
        for name in args.modes.split(","):
            rows.append(summarise(name, run_mode(name, args, teacher, work)))
            print(table(rows[-1:]), flush=True)
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
