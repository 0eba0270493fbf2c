"""The world's Harbor tasks on our providers: oracle and do-nothing rewards, seconds, why a miss.

Usage:
    python bench/bench_harbor_world.py DIR [--providers local,docker] [--concurrency 2]
        [--only NAME,NAME] [--out bench/results/harbor_world.md] [--label before]

DIR holds Terminal-Bench-2 / Harbor task folders (task.toml, instruction.md or steps/,
environment/, tests/, solution/) that nobody here wrote; they are not in the repository (the
sample this project measured lives outside it, see bench/results/harbor_world.md for where it
came from). For every task and provider the task runs twice as `env validate` runs it
(miles_env/validate/probes.py): its reference solution (oracle, want 1) and a do-nothing agent
(nop, want 0), each in a fresh sandbox, the verifier run on the final state. A task passes on a
provider when oracle == 1 and nop == 0. For a miss the table gives one line: the error, or the
last informative line of the verifier's (or the solution's) output.

Seconds are wall time per probe (sandbox create, image build when not cached, setup, script,
three verifies) on this loaded 2-core machine: compare providers within one run only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
_NOISE = re.compile(r"^(\s*\|?\s*)$|^=+|^-+$|short test summary|^PASSED|^\[|^Reading|^Get:|^Hit:")


@dataclass(frozen=True, slots=True)
class Cell:
    oracle: float | None
    nop: float | None
    seconds: float
    reason: str

    @property
    def ok(self) -> bool:
        return self.oracle == 1.0 and self.nop == 0.0


def one_line(text: str, limit: int = 140) -> str:
    """The last informative line of some output, cut to `limit` characters."""
    lines = [ln.strip().lstrip("|").strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not _NOISE.search(ln)]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _reason(oracle, nop) -> str:  # type: ignore[no-untyped-def]
    from miles_env.adapters.harbor.diagnose import hint

    if oracle.error:
        first = oracle.error.split("\n")[0]
        if "; a RUN step needs " in first:  # a build names the host its failing step needs
            return "oracle: " + one_line(first.rsplit("; ", 1)[1])
        return "oracle: " + one_line(hint(oracle.error) or first)
    if oracle.score < 1.0:
        why = one_line(oracle.verifier_tail) or one_line(oracle.solution_tail) or "no output"
        return f"oracle {oracle.score:g}: {why}"
    if nop.error:
        return "nop: " + one_line(nop.error)
    if nop.score > 0.0:
        return f"nop {nop.score:g}: the verifier passes an untouched sandbox"
    return ""


def load(dir_: Path, only: set[str]) -> tuple[object, list[object], list[str]]:
    """(environment, its tasks, the task folders it could not read, each with its reason)."""
    from miles_env.adapters.harbor import HarborTasksEnvironment

    env = HarborTasksEnvironment(dir_, name="harbor-world")
    tasks = [t for t in env.tasks("test") if not only or t.id in only]
    return env, tasks, [f"{p.path.name}: {p.reason}" for p in env.problems]


async def run_provider(env, tasks, provider_name: str, concurrency: int, network: str) -> dict[str, Cell]:  # type: ignore[no-untyped-def]
    from miles_env.limits import LimitsOverride
    from miles_env.sandbox import AsyncClosable
    from miles_env.sandboxes import get_provider
    from miles_env.types import NetworkPolicy
    from miles_env.validate.probes import run_probes

    provider = get_provider(provider_name)
    limits = LimitsOverride(network=NetworkPolicy(network)) if network != "task" else None
    try:
        oracle, nop = await run_probes(env, tasks, provider, concurrency, limits)
    finally:
        if isinstance(provider, AsyncClosable):
            await provider.aclose()
    out = {}
    for o, n in zip(oracle, nop, strict=True):
        out[o.task_id] = Cell(
            None if o.error else o.score, None if n.error else n.score,
            o.duration_s + n.duration_s, _reason(o, n),
        )  # fmt: skip
    return out


def base_of(task) -> str:  # type: ignore[no-untyped-def]
    from miles_env.adapters.harbor.taskdir import final_stage

    df = Path(task.verifier["task_dir"]) / "environment" / "Dockerfile"
    if not df.is_file():
        return task.sandbox.image or "-"
    stage = final_stage(df.read_text())
    words = [
        w
        for w in (stage[0].args.split() if stage and stage[0].op == "FROM" else [])
        if not w.startswith("--")
    ]
    return words[0] if words else "-"


def obtainable(task) -> str:  # type: ignore[no-untyped-def]
    """How the task's bases are had here ("substitute", "bootstrap", ...), or "no" and why."""
    from miles_env.sandboxes.images.dockerfile import parse_dockerfile
    from miles_env.sandboxes.images.local import LocalImages

    df = Path(task.verifier["task_dir"]) / "environment" / "Dockerfile"
    if not df.is_file():
        return "no: no Dockerfile"
    resolver = _RESOLVER.setdefault("r", LocalImages().resolver)
    sources = []
    for ref in parse_dockerfile(df.read_text()).external_images():
        try:
            sources.append(resolver.resolve(ref).source)
        except Exception as e:  # BaseUnavailable: its message names the base and the remedies
            return f"no: {str(e).split(';')[0][:90]}"
    return "+".join(dict.fromkeys(sources)) or "no: no FROM"


_RESOLVER: dict[str, object] = {}


def _fmt(v: float | None) -> str:
    return "err" if v is None else f"{v:g}"


def table(tasks, results: dict[str, dict[str, Cell]], bad: list[str]) -> str:  # type: ignore[no-untyped-def]
    providers = list(results)
    here = {t.id: obtainable(t) for t in tasks}
    head = (
        "| task | base | base here | "
        + " | ".join(f"{p} oracle | {p} nop | {p} s" for p in providers)
        + " | miss (one line) |"
    )
    sep = "|" + "---|" * (4 + 3 * len(providers))
    rows = [head, sep]
    for t in tasks:
        cells = [results[p][t.id] for p in providers]
        vals = " | ".join(f"{_fmt(c.oracle)} | {_fmt(c.nop)} | {c.seconds:.0f}" for c in cells)
        why = "; ".join(f"{p}: {c.reason}" for p, c in zip(providers, cells, strict=True) if c.reason)
        rows.append(f"| {t.id} | {base_of(t)} | {here[t.id]} | {vals} | {why.replace('|', '/')} |")
    for b in bad:
        rows.append(f"| {b.split(':', 1)[0]} | - | - | " + " | ".join("not loaded" for _ in range(3 * len(providers)))
                    + f" | {b.split(':', 1)[1].strip().replace('|', '/')} |")  # fmt: skip
    lines = ["\n".join(rows), ""]
    for p in providers:
        ok = sum(results[p][t.id].ok for t in tasks)
        lines.append(f"- {p}: {ok}/{len(tasks) + len(bad)} tasks reach oracle 1 and nop 0")
    both = sum(all(results[p][t.id].ok for p in providers) for t in tasks)
    lines.append(f"- all of {', '.join(providers)}: {both}/{len(tasks) + len(bad)}")
    had = [t for t in tasks if not here[t.id].startswith("no")]
    ok_had = sum(all(results[p][t.id].ok for p in providers) for t in had)
    pct = 100 * ok_had / len(had) if had else 0.0
    lines.append(
        f"- of the {len(had)} tasks whose bases are obtainable here: {ok_had} ({pct:.0f}%) on all of them"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--providers", default="local,docker")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated task folder names")
    ap.add_argument(
        "--network",
        default="none",
        choices=["none", "task"],
        help="none: every sandbox offline, as during RL (default); task: each task's allow_internet",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the table (markdown) here")
    ap.add_argument("--label", default="", help="a heading for this run, e.g. 'before'")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw cells as JSON")
    args = ap.parse_args()
    env, tasks, bad = load(args.dir.resolve(), {x for x in args.only.split(",") if x})
    results: dict[str, dict[str, Cell]] = {}
    for p in args.providers.split(","):
        t0 = time.monotonic()
        results[p] = anyio.run(run_provider, env, tasks, p, args.concurrency, args.network)
        print(f"{p}: {len(tasks)} tasks in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    text = table(tasks, results, bad)
    cmd = "python bench/bench_harbor_world.py " + " ".join(sys.argv[1:])
    page = f"## {args.label or 'run'}\n\n`{cmd}`\n\n{text}\n"
    print(page)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page)
    if args.json:
        raw = {p: {k: c.__dict__ if hasattr(c, "__dict__") else _cell(c) for k, c in r.items()}
               for p, r in results.items()}  # fmt: skip
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


def _cell(c: Cell) -> dict[str, object]:
    return {"oracle": c.oracle, "nop": c.nop, "seconds": round(c.seconds, 1), "reason": c.reason}


if __name__ == "__main__":
    sys.exit(main())
