"""Scale-out throughput: episodes per minute with 1, 2 and 4 Ray rollout workers (issue 17).

    python bench/bench_scale.py [--workers 1,2,4] [--groups 16] [--group-size 4] [--rounds 2] [--extras]

The real cluster path of `miles-env train` with `cluster.address` set, less the trainer: a local
multi-node Ray cluster (`ray.cluster_utils.Cluster`, a head of 0 CPUs and max(workers) worker
nodes, each offering 1 CPU and {"rollout": 1}), a redis-server (AOF, appendfsync always, as the
queue recommends), and `cluster_rollouts` (miles_env/cluster/driver.py) exactly as the job uses
it: the driver serves a ScriptedEngine (zero model cost, so orchestration is what is measured)
through the embedded SGLang-compatible server, each `RolloutWorker` actor opens its own TITO proxy
and bubblewrap sandboxes, rolls groups of terminal-basics out and puts them into Redis. The
training step is replaced by a consumer on the driver that takes each group as soon as it is
complete and acks it (the loop's take/ack, no gradient step), so a run's time is dispatch ->
rollout -> put -> take -> ack of a fixed number of groups, from the first dispatch to the last
ack. Worker start-up (Ray placement, stack open) and a first group per worker (first sandbox,
first request, first put: warm-up) are excluded; each configuration is one
`cluster_rollouts` session, rounds alternate the order of the configurations.

Each episode: sandbox create + task setup, a turn that answers one shell command (`ls -la`,
run in the sandbox), a turn that answers DONE, the task's checks, sandbox close.

Where the time goes: the CPU time each process family spent during the timed window (psutil;
children reaped by a process count for it, so a worker's bubblewrap sandboxes count as the
worker's; "not this bench" is the machine's busy CPU time less those), the machine's busy fraction over the window and the 1-minute load average after it.

Output: one line per run, then a table of medians with efficiency = rate(n) / (n * rate(1)).
`--extras` then runs the issue's two other figures briefly, each through its own benchmark:
bench_router.py (latency the sglang-router adds per turn) and bench_queue.py --backends (put +
take + ack of 4k-token episodes, SQLite vs Redis); their full runs are bench/results/router.md
and bench/results/queue_backends.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_env.cluster.driver import ClusterRollouts, cluster_rollouts  # noqa: E402
from miles_env.config import RunConfig, load_config  # noqa: E402
from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy  # noqa: E402
from miles_env.models import load_tokenizer  # noqa: E402
from miles_env.queue.config import build_queue  # noqa: E402
from miles_env.registry import load_environment  # noqa: E402
from miles_env.types import Task  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

__all__ = ["main"]

MB = 1024 * 1024
POLICY = ScriptedPolicy((PolicyRule(None, ("```bash\nls -la\n```", "DONE")),))
FAMILIES = ("driver", "rollout workers", "raylets", "gcs+other ray", "redis", "not this bench")


@dataclass(frozen=True, slots=True)
class Run:
    workers: int
    episodes: int
    wall_s: float
    cpu_s: dict[str, float]  # CPU seconds per process family during the window
    busy: float  # machine busy fraction over the window (all cores)
    load1: float

    @property
    def per_min(self) -> float:
        return self.episodes / self.wall_s * 60


def _family(p: psutil.Process, redis_pid: int) -> str:
    if p.pid == os.getpid():
        return "driver"
    if p.pid == redis_pid:
        return "redis"
    name, cmd = p.name(), " ".join(p.cmdline())
    if "RolloutWorker" in cmd or "RolloutWorker" in name:
        return "rollout workers"
    if name == "raylet" or "/raylet" in cmd:
        return "raylets"
    if "gcs_server" in name or "ray" in cmd:
        return "gcs+other ray"
    return "not this bench"


def _cpu_snapshot(redis_pid: int) -> dict[int, tuple[str, float]]:
    snap = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            snap[p.pid] = (_family(p, redis_pid), t.user + t.system + t.children_user + t.children_system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return snap


def _cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    out = dict.fromkeys(FAMILIES[:-1], 0.0)
    for pid, (fam, t) in after.items():
        if fam in out:
            out[fam] += t - before.get(pid, (fam, 0.0))[1]
    return out


def _config(run_dir: Path, address: str, redis_url: str, workers: int, a: argparse.Namespace) -> RunConfig:
    sets = [
        f"run_dir={run_dir}", "engine.kind=scripted", "env=terminal-basics", "eval.enabled=false",
        f"rollout.group_size={a.group_size}", f"rollout.groups_per_step={a.groups}",
        f"rollout.concurrency={a.concurrency}", "harness.max_turns=2", "harness.max_tokens=32",
        "queue.kind=redis", f"queue.url={redis_url}", f"queue.prefix=scale-{run_dir.name}",
        f"cluster.address={address}", f"cluster.rollout_workers={workers}",
        "cluster.worker_resources={rollout: 1}",
    ]  # fmt: skip
    return load_config(None, sets)


async def _consume(cfg: RunConfig, groups: int) -> int:
    """The loop's side without the trainer: take each complete group and ack it; episodes acked."""
    queue = build_queue(cfg.queue, cfg.run_dir, group_size=cfg.rollout.group_size,
                        max_pending_groups=2 * groups)  # fmt: skip
    aq, done, episodes = queue.aio, 0, 0
    try:
        while done < groups:
            leases = await aq.take(groups - done)
            if not leases:
                await anyio.sleep(0.02)
                continue
            await aq.ack(leases)
            done += len(leases)
            episodes += sum(len(lease.episodes) for lease in leases)
    finally:
        queue.close()
    return episodes


async def _drive(cfg: RunConfig, dispatch: ClusterRollouts, tasks: list[Task]) -> int:
    """Dispatch `tasks` while the consumer takes and acks their groups; episodes acked."""
    result: list[int] = []

    async def consumer() -> None:
        result.append(await _consume(cfg, len(tasks)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await dispatch(tasks)
    return result[0]


async def _one(cfg: RunConfig, engine: ScriptedEngine, tasks: list[Task], redis_pid: int) -> Run:
    async with cluster_rollouts(cfg, engine) as dispatch:
        # warm-up, untimed: one group per worker (first sandbox, first request, first put)
        await _drive(cfg, dispatch, tasks[: cfg.cluster.rollout_workers])
        before, cpu0, t0 = _cpu_snapshot(redis_pid), psutil.cpu_times(), time.perf_counter()
        episodes = await _drive(cfg, dispatch, tasks)
        wall = time.perf_counter() - t0
        cpu1, after = psutil.cpu_times(), _cpu_snapshot(redis_pid)
    total = sum(cpu1) - sum(cpu0)
    busy_s = total - (cpu1.idle - cpu0.idle + cpu1.iowait - cpu0.iowait)
    cpu_s = _cpu_delta(before, after)
    cpu_s["not this bench"] = max(0.0, busy_s - sum(cpu_s.values()))  # the machine's busy rest
    return Run(cfg.cluster.rollout_workers, episodes, wall, cpu_s, busy_s / total if total else 0.0,
               os.getloadavg()[0])  # fmt: skip


def _print_run(r: Run) -> None:
    cpu = " ".join(f"{k}={v:.1f}" for k, v in r.cpu_s.items())
    print(f"workers={r.workers} episodes={r.episodes} wall={r.wall_s:.1f}s ep/min={r.per_min:.1f} "
          f"busy={r.busy:.2f} load1={r.load1:.1f} cpu_s: {cpu}", flush=True)  # fmt: skip


def _report(runs: list[Run], workers: list[int]) -> None:
    med = {n: statistics.median(r.per_min for r in runs if r.workers == n) for n in workers}
    base = med[workers[0]] / workers[0]
    print(
        "\n| rollout workers | episodes/min (median) | linear | efficiency | busy | "
        + " | ".join(f"CPU s/episode: {f}" for f in FAMILIES)
        + " |"
    )
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(FAMILIES))
    for n in workers:
        mine = [r for r in runs if r.workers == n]
        eps = sum(r.episodes for r in mine)
        per = [sum(r.cpu_s[f] for r in mine) / eps for f in FAMILIES]
        busy = statistics.median(r.busy for r in mine)
        print(f"| {n} | {med[n]:.1f} | {n * base:.1f} | {med[n] / (n * base):.2f} | {busy:.2f} | "
              + " | ".join(f"{x:.3f}" for x in per) + " |")  # fmt: skip


async def _main(a: argparse.Namespace) -> None:
    from ray.cluster_utils import Cluster

    workers = [int(x) for x in a.workers.split(",")]
    env = load_environment("terminal-basics")
    pool = env.tasks()
    tasks = [pool[i % len(pool)] for i in range(a.groups)]
    engine = ScriptedEngine(load_tokenizer("smollm2"), policy=POLICY, record=False)
    out = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * MB}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    runs: list[Run] = []
    try:
        for _ in range(max(workers)):
            cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=100 * MB)
        cluster.wait_for_nodes()
        with RedisServer(out / "redis") as redis_server:
            assert redis_server.proc is not None
            redis_pid = redis_server.proc.pid
            for rnd in range(a.rounds):
                for n in workers if rnd % 2 == 0 else workers[::-1]:
                    cfg = _config(out / f"r{rnd}-w{n}", cluster.address, redis_server.url, n, a)
                    runs.append(await _one(cfg, engine, tasks, redis_pid))
                    _print_run(runs[-1])
    finally:
        cluster.shutdown()
    print(f"\n{a.groups} groups x {a.group_size} episodes per run, rollout.concurrency={a.concurrency} "
          f"per worker, {a.rounds} rounds, {os.cpu_count()} cores")  # fmt: skip
    _report(runs, workers)
    if a.extras:
        _extras()


def _extras() -> None:
    """The issue's two other figures, short runs of their own benchmarks (full runs: bench/results)."""
    here = Path(__file__).resolve().parent
    for argv in (
        ["bench_router.py", "--rounds", "2", "--sessions", "8"],  # one turn at a time, 1k prompts
        ["bench_queue.py", "--backends", "--rounds", "1", "--episodes", "256", "--tokens", "4096"],
    ):
        print(f"\n$ python bench/{' '.join(argv)}", flush=True)
        subprocess.run([sys.executable, str(here / argv[0]), *argv[1:]], check=True, timeout=600)  # noqa: S603


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="episodes at once on one worker")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--extras", action="store_true", help="then short router and queue-backend runs")
    anyio.run(_main, ap.parse_args())


if __name__ == "__main__":
    main()
