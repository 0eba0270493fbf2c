"""`miles-env eval`: run real episodes of an environment and report the pass rate.

Episodes are written as JSONL (one Episode per line, with token ids, masks,
logprobs, rewards and the transcript) to OUT/episodes.jsonl.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import typer

from miles_env.errors import MilesEnvError
from miles_env.http import loop_options
from miles_env.jsonio import dumps, write_json
from miles_env.types import Episode, EpisodeEnd

if TYPE_CHECKING:
    from miles_env.config import RunConfig

__all__ = ["episode_line", "eval_command", "summarize"]


def summarize(episodes: list[Episode]) -> dict[str, Any]:
    from miles_env.evals.base import episode_stats  # the run's own rates (rollout: not at CLI start)

    n = len(episodes)
    sampled = sum(s.n_sampled for e in episodes for s in e.samples)
    total = sum(len(s.token_ids) for e in episodes for s in e.samples)
    statuses: dict[str, int] = {}
    ends: dict[str, int] = {}  # end classes (types.EpisodeEnd): policy ends and infrastructure failures
    flags: dict[str, int] = {}  # reward-hacking flags (miles_env/guards): episodes raising each
    for e in episodes:
        statuses[e.status.value] = statuses.get(e.status.value, 0) + 1
        ends[e.end.value] = ends.get(e.end.value, 0) + 1
        for f in e.flags:
            flags[f] = flags.get(f, 0) + 1
    firsts = [size for e in episodes if (size := e.metadata.get("first_prompt_tokens")) is not None]
    return {
        "episodes": n,
        "pass_rate": (sum(1 for e in episodes if e.reward is not None and e.reward.passed) / n) if n else 0.0,
        "pass_rate_policy": episode_stats(episodes)["pass_rate_policy"],  # over policy ends only
        "mean_reward": (sum(e.score for e in episodes) / n) if n else 0.0,
        "sampled_tokens": sampled,
        "total_tokens": total,
        "statuses": statuses,
        "ends": dict(sorted(ends.items())),
        "infra_failures": sum(n for k, n in ends.items() if not EpisodeEnd(k).policy),
        "flags": flags,
        # what the harness's first request cost (rollout.py): does it fit a small model?
        "first_prompt_tokens": {"min": min(firsts), "max": max(firsts)} if firsts else None,
    }


def episode_line(ep: Episode) -> str:
    """One episode as the eval prints it: task, status, reward, the first prompt's size, the error."""
    first = ep.metadata.get("first_prompt_tokens")
    sampled = sum(s.n_sampled for s in ep.samples)
    line = f"{ep.task_id}: {ep.status.value}  reward {ep.score:.2f}  first prompt {first} tokens  sampled {sampled}"
    return line + (f"  ({ep.error})" if ep.error else "")


async def _run(
    env_name: str, split: str, n: int | None, rollouts: int, concurrency: int, cfg: RunConfig, out: Path
) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from miles_env.harnesses import build_harness
    from miles_env.registry import load_environment
    from miles_env.rollout import run_many
    from miles_env.stack import StackConfig, open_stack

    env = load_environment(env_name)
    tasks = env.tasks(split)[: n if n else None]
    if not tasks:
        raise MilesEnvError(f"environment {env_name!r} has no tasks in split {split!r}")
    harness = build_harness(cfg.harness)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "episodes.jsonl"
    episodes: list[Episode] = []
    stack_cfg = StackConfig(engine=cfg.engine, sandbox=cfg.sandbox, store_dir=out / "sessions")
    async with open_stack(stack_cfg) as stack:
        with (
            Progress(
                TextColumn("[bold]eval[/] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            ) as progress,
            path.open("w") as fh,
        ):
            bar = progress.add_task(env_name, total=len(tasks) * rollouts)

            def record(ep: Episode) -> None:
                episodes.append(ep)
                fh.write(ep.model_dump_json() + "\n")
                fh.flush()
                progress.console.print(episode_line(ep), highlight=False, markup=False)
                passed = sum(1 for e in episodes if e.reward is not None and e.reward.passed)
                progress.update(bar, advance=1, description=f"{env_name} pass {passed}/{len(episodes)}")

            ctx = replace(stack.rollout_context(env, harness), guards=cfg.guards)
            await run_many(ctx, tasks, rollouts_per_task=rollouts, concurrency=concurrency, on_episode=record)
    summary = summarize(episodes)
    write_json(out / "summary.json", summary)
    return summary


def _span(first: dict[str, int] | None) -> str:
    if first is None:
        return "-"
    return str(first["min"]) if first["min"] == first["max"] else f"{first['min']}-{first['max']}"


def parse_opts(pairs: list[str] | None, flag: str) -> dict[str, Any]:
    """`key=value` pairs; a value that parses as JSON (numbers, true, lists) is taken as such."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{flag} {pair!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def eval_command(
    env: Annotated[str, typer.Option("--env", help="environment name (see `miles-env env list`)")],
    harness: Annotated[
        str, typer.Option(help="builtin | claude-code | codex | opencode | mini-swe-agent | framework")
    ] = "builtin",
    split: Annotated[str, typer.Option(help="task split")] = "test",
    n: Annotated[int | None, typer.Option("--n", help="number of tasks (default: all in the split)")] = None,
    rollouts: Annotated[int, typer.Option("--rollouts", "-r", help="episodes per task")] = 1,
    concurrency: Annotated[int, typer.Option(help="episodes at once")] = 8,
    engine: Annotated[str, typer.Option(help="hf | vllm | sglang | scripted")] = "hf",
    model: Annotated[str, typer.Option(help="'smollm2' or a local HF checkpoint path")] = "smollm2",
    url: Annotated[
        str | None, typer.Option(help="engine server URL (vllm, sglang: attach instead of launch)")
    ] = None,
    max_turns: Annotated[int | None, typer.Option(help="harness turn budget")] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature")] = None,
    sandbox: Annotated[str, typer.Option(help="sandbox provider")] = "local",
    out: Annotated[Path, typer.Option(help="output directory")] = Path("runs/eval"),
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    engine_opt: Annotated[
        list[str] | None,
        typer.Option("--engine-opt", help="engine config key=value (e.g. script=policy.json)"),
    ] = None,
    harness_opt: Annotated[
        list[str] | None, typer.Option("--harness-opt", help="harness config key=value (e.g. budget_s=120)")
    ] = None,
) -> None:
    """Run episodes with a harness through the TITO proxy and report the pass rate."""
    from miles_env.config import validate_config

    engine_cfg: dict[str, Any] = {"kind": engine, "model": model, **parse_opts(engine_opt, "--engine-opt")}
    if url:
        engine_cfg["url"] = url
    if engine in ("vllm", "sglang"):
        engine_cfg.setdefault("log_dir", str(out / "engine"))  # a launched server's log
    harness_cfg: dict[str, Any] = parse_opts(harness_opt, "--harness-opt")
    if max_turns is not None:
        harness_cfg["max_turns"] = max_turns
    if temperature is not None:
        harness_cfg["temperature"] = temperature
    sections = {
        "engine": engine_cfg,
        "harness": {"name": harness, **harness_cfg},
        "sandbox": {"provider": sandbox},
    }
    cfg = validate_config(sections, "the --engine/--harness/--sandbox options")  # every bad option, now
    args = (env, split, n, rollouts, concurrency, cfg, out)
    summary = anyio.run(_run, *args, backend_options=loop_options())  # the in-process proxy on uvloop
    if as_json:
        typer.echo(dumps(summary))
        return
    typer.echo(
        f"episodes {summary['episodes']}  pass rate {summary['pass_rate']:.3f}  "
        f"mean reward {summary['mean_reward']:.3f}  sampled tokens {summary['sampled_tokens']}  "
        f"total tokens {summary['total_tokens']}  statuses {summary['statuses']}  flags {summary['flags']}\n"
        f"ends {summary['ends']}  infrastructure failures (not the policy's) {summary['infra_failures']}  "
        f"pass rate over policy ends {summary['pass_rate_policy']:.3f}\n"
        f"first prompt {_span(summary['first_prompt_tokens'])} tokens\n"
        f"written to {out}/episodes.jsonl"
    )
