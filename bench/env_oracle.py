"""Oracle throughput of the built-in environments through the local bubblewrap sandbox.

Runs every reference solution (sandbox create + setup + solution + checks + close)
at several concurrency levels; the baseline is concurrency 1 in the same run.

    python bench/env_oracle.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import anyio

from miles_env.oracle import run_oracle
from miles_env.registry import load_environment
from miles_env.sandboxes import get_provider


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--levels", default="1,2,4,8")
    args = ap.parse_args()
    provider = get_provider("local")
    print(f"{'env':16} {'conc':>4} {'tasks':>5} {'pass':>5} {'best s':>7} {'tasks/s':>8} {'vs c=1':>7}")
    for name in ("terminal-basics", "terminal-hard"):
        env = load_environment(name)
        tasks = env.tasks()
        base = None
        for conc in (int(x) for x in args.levels.split(",")):
            best, passed = float("inf"), 0
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                report = anyio.run(run_oracle, env, tasks, provider, conc)
                best = min(best, time.perf_counter() - t0)
                passed = report.n_passed
            base = base or best
            print(f"{name:16} {conc:>4} {len(tasks):>5} {passed:>5} {best:>7.2f} "
                  f"{len(tasks) / best:>8.1f} {base / best:>6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
