"""Adapter overhead: the same framework verifier called through a worker vs in process, and worker start.

For each framework, a small bench worker (adapters/workers/_rpc.py protocol) runs inside
the framework's venv and exposes `verify(answer)`, which calls the framework's own
verifier once: verifiers: the `@vf.reward` of adapters/examples/vf_say_word.py; hud: the
`@env.template` generator of adapters/examples/hud_say_word.py (prompt, then answer ->
reward); nemo-gym: the shipped `mcqa` resources server's `verify()` on an example
rollout; openenv: reset+step of adapters/examples/openenv_guess.py. `inproc(n)` times the
same call n times inside the worker (no protocol). Overhead = worker round trip minus
in-process time. Worker start = the real adapter worker's time to its ready line and to
its first answered call (listing tasks). Harbor: native verify (test.sh in our sandbox)
against Harbor's own Trial with the `nop` agent on the same sandbox provider.

Run: python bench/bench_adapters.py [--n 200]   (installs the five venvs if missing)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

import miles_env.adapters as pkg
from miles_env.adapters.venv import get_spec, install, venv_python
from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient, python_argv

EX = Path(pkg.__file__).parent / "examples"
COMMON = f"""
import asyncio, sys, time, json
sys.path[:0] = [{str(WORKERS_DIR)!r}, {str(EX)!r}]
import _rpc
async def inproc(p):
    t = []
    for _ in range(p["n"]):
        t0 = time.perf_counter(); await verify({{"answer": p["answer"]}}); t.append(time.perf_counter() - t0)
    t.sort(); return t[len(t) // 2]
"""
VERIFIERS = {
    "verifiers": """
from types import SimpleNamespace
from vf_say_word import SayTask, SayData
TASK = SayTask(SayData(word="river"))
async def verify(p): return await TASK.said_it(SimpleNamespace(last_reply=p["answer"]))
""",
    "hud": """
from hud_say_word import say
async def verify(p):
    gen = say.func(word="river"); await gen.__anext__(); r = await gen.asend(p["answer"]); await gen.aclose(); return r
""",
    "nemo-gym": """
import os; os.environ.setdefault("NEMO_GYM_CONFIG_DICT", "{}")
from pathlib import Path
import resources_servers.mcqa.app as m
from nemo_gym.server_utils import ServerClient
from nemo_gym.config_types import BaseServerConfig
from omegaconf import OmegaConf
data = Path(m.__file__).parent / "data"
row = json.loads((data / "example.jsonl").read_text().splitlines()[0])
row["response"] = json.loads((data / "example_rollouts.jsonl").read_text().splitlines()[0])["response"]
SERVER = m.MCQAResourcesServer(
    config=m.MCQAResourcesServerConfig(host="127.0.0.1", port=1, entrypoint="app.py", name="r", domain="other"),
    server_client=ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                               global_config_dict=OmegaConf.create({})))
BODY = m.MCQAVerifyRequest.model_validate(row)
async def verify(p): return (await SERVER.verify(BODY)).reward
""",
    "openenv": """
from openenv_guess import GuessEnv, GuessAction
ENV = GuessEnv()
async def verify(p): ENV.reset(seed=1); return ENV.step(GuessAction(message=p["answer"])).reward
""",
}
REAL = {  # the adapter worker and its arguments, for start time
    "verifiers": ("verifiers_worker.py", (str(EX / "vf_say_word"), str(EX))),
    "hud": ("hud_worker.py", (str(EX / "hud_say_word.py"),)),
    "nemo-gym": ("nemo_gym_worker.py", ("mcqa",)),
    "openenv": ("openenv_worker.py", (f"{EX / 'openenv_guess.py'}:app",)),
}


async def one(name: str, n: int, tmp: Path) -> dict[str, float]:
    script = tmp / f"bench_{name.replace('-', '_')}.py"
    script.write_text(COMMON + VERIFIERS[name] + "\n_rpc.serve({'verify': verify, 'inproc': inproc})\n")
    w = WorkerClient([str(venv_python(name)), "-u", str(script)], env=get_spec(name).env, name=name)
    await w.call("verify", {"answer": "river"})  # warm: imports, first-call caches
    rt = []
    for _ in range(n):
        t0 = time.perf_counter()
        await w.call("verify", {"answer": "\\boxed{B} river"})
        rt.append(time.perf_counter() - t0)
    inproc = float(await w.call("inproc", {"answer": "\\boxed{B} river", "n": n}))
    await w.aclose()
    script_name, args = REAL[name]
    t0 = time.perf_counter()
    real = WorkerClient(python_argv(venv_python(name), script_name, *args), env=get_spec(name).env, name=name)
    if name == "openenv":
        await real.call("info")
    else:
        await real.call("tasks")
    first = time.perf_counter() - t0
    ready = real.start_s
    await real.aclose()
    return {"inproc": inproc, "worker": statistics.median(rt), "ready": ready, "first": first}


async def harbor(n: int, tmp: Path) -> dict[str, float]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_adapters_harbor import make_task  # the same small task the tests use

    from miles_env.adapters.harbor import HarborTasksEnvironment, run_harbor_trial
    from miles_env.oracle import run_solution
    from miles_env.sandboxes import get_provider

    task_dir = make_task(tmp / "harbor")
    env = HarborTasksEnvironment(task_dir)
    (task,) = env.tasks("test")
    provider = get_provider("local")
    native = []
    for _ in range(max(3, n // 20)):
        t0 = time.perf_counter()
        await run_solution(env, task, provider, "true")
        native.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    await run_harbor_trial(task_dir, "nop", provider, trials_dir=tmp / "trials")
    first = time.perf_counter() - t0
    trial = []
    for _ in range(max(3, n // 20)):
        t0 = time.perf_counter()
        await run_harbor_trial(task_dir, "nop", provider, trials_dir=tmp / "trials")
        trial.append(time.perf_counter() - t0)
    from miles_env.adapters.worker_pool import close_workers

    await close_workers()
    return {"native": statistics.median(native), "trial": statistics.median(trial), "first": first}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    for name in ("verifiers", "hud", "nemo-gym", "openenv", "harbor"):
        install(name)
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    rows: dict[str, Any] = {name: anyio.run(one, name, n, tmp) for name in VERIFIERS}
    print(
        "| adapter | verifier in process | via worker | overhead per call | ratio | worker ready | first answer |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['inproc'] * 1e3:.3f} ms | {r['worker'] * 1e3:.3f} ms | "
            f"{(r['worker'] - r['inproc']) * 1e3:.3f} ms | {r['worker'] / max(r['inproc'], 1e-9):.0f}x | "
            f"{r['ready']:.2f} s | {r['first']:.2f} s |"
        )
    h = anyio.run(harbor, n, tmp)
    print(
        f"\nharbor: native verify episode (sandbox + nop + test.sh) {h['native'] * 1e3:.0f} ms; "
        f"Harbor's own Trial (nop) on our sandbox {h['trial'] * 1e3:.0f} ms "
        f"({h['trial'] / h['native']:.1f}x); first trial incl. worker start {h['first']:.2f} s"
    )


if __name__ == "__main__":
    main()
