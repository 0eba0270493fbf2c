"""The registration gate: `miles-env env validate NAME`, the checks an environment passes first.

Concept: five stages, in order, on CPU in minutes (report.py renders them):

1. schema: every task is a valid Task in its split with a unique id, a non-blank instruction
   and a reference solution (probes.schema_stage);
2. oracle: each reference solution scores 1 in a real sandbox (probes.py);
3. nop: a do-nothing agent scores 0 on every task; the tasks it passes are listed;
4. determinism: the same final state and transcript get the same reward from 3 verifies;
5. train: a 2-step GRPO run on SmolLM2 through the real job (train.py); `--quick` skips only
   this stage and the report says so.

NAME is a registered environment, a `module.path:attr`, an adapter reference
(`harbor:/path`) or a directory of Harbor tasks (read as `harbor:<dir>`).

Invariant: `validate_env` never raises for a fault of the environment: a load failure is a
failed schema stage and the later stages are marked skipped; the report passes only when
every stage ran and passed (train may be skipped only with quick=True).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import anyio

from miles_env.environment import Environment
from miles_env.errors import MilesEnvError
from miles_env.limits import LimitsOverride
from miles_env.provenance import env_distribution
from miles_env.sandbox import AsyncClosable
from miles_env.types import NetworkPolicy, Task
from miles_env.validate.probes import judge, run_probes, schema_stage
from miles_env.validate.report import STAGES, StageResult, ValidationReport
from miles_env.validate.train import train_stage

__all__ = ["StageResult", "ValidationReport", "resolve_name", "validate_env"]


def resolve_name(name: str) -> str:
    """A directory holding Harbor tasks (not a registered name) becomes `harbor:<absolute dir>`."""
    path = Path(name).expanduser()
    if ":" not in name and path.is_dir():
        return f"harbor:{path.resolve()}"
    return name


def _skipped(after: str, why: str) -> tuple[StageResult, ...]:
    return tuple(StageResult(s, False, why, skipped=True) for s in STAGES[STAGES.index(after) + 1 :])


async def _sandbox_stages(
    env: Environment, tasks: list[Task], provider_name: str, concurrency: int, limits: LimitsOverride | None
) -> list[StageResult]:
    from miles_env.sandboxes import get_provider

    provider = get_provider(provider_name)
    t0 = time.monotonic()
    try:
        oracle, nop = await run_probes(env, tasks, provider, concurrency, limits)
    finally:
        if isinstance(provider, AsyncClosable):
            await provider.aclose()
    return judge(oracle, nop, time.monotonic() - t0)


def validate_env(
    name: str,
    *,
    provider: str = "local",
    quick: bool = False,
    concurrency: int = 4,
    model: str = "smollm2",
    work_dir: Path | None = None,
    network: str | None = None,
) -> ValidationReport:
    """Run the gate on `name`; `work_dir` keeps the train stage's run (default: a temporary dir);
    `network="none"` forbids the network to every task's sandbox (a task's `public` or `host`)."""
    from miles_env.registry import load_environment

    name = resolve_name(name)
    t0 = time.monotonic()
    try:
        env = load_environment(name, validate=False)
    except (MilesEnvError, ImportError) as e:
        failed = StageResult("schema", False, "the environment did not load", (f"{type(e).__name__}: {e}",))
        return ValidationReport(name, provider, stages=(failed, *_skipped("schema", "not run")), quick=quick)
    schema, tasks = schema_stage(env)
    schema = StageResult(schema.name, schema.passed, schema.summary, schema.problems,
                         duration_s=time.monotonic() - t0)  # fmt: skip
    base = ValidationReport(name, provider, env_distribution(env), len(tasks), quick=quick)
    if not tasks:
        return _with(base, schema, *_skipped("schema", "not run: no valid tasks"))
    try:
        limits = LimitsOverride(network=NetworkPolicy(network)) if network else None
        checked = anyio.run(_sandbox_stages, env, tasks, provider, concurrency, limits)
    except (MilesEnvError, ValueError) as e:  # the provider itself could not be built, a bad --network
        failed = StageResult("oracle", False, "the sandbox provider failed", (str(e),))
        return _with(base, schema, failed, *_skipped("oracle", "not run"))
    if quick:
        train = StageResult("train", False, "skipped (--quick): no 2-step GRPO run", skipped=True)
    elif work_dir is not None:
        train = train_stage(name, env, work_dir, provider=provider, model=model)
    else:
        with tempfile.TemporaryDirectory(prefix="miles-env-validate-") as tmp:
            train = train_stage(name, env, Path(tmp), provider=provider, model=model)
    return _with(base, schema, *checked, train)


def _with(base: ValidationReport, *stages: StageResult) -> ValidationReport:
    return ValidationReport(
        base.env, base.provider, base.distribution, base.n_tasks, tuple(stages), base.quick
    )
