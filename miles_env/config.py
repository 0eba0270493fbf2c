"""The run configuration of `miles-env train`: one typed config per component, composed.

A YAML (or TOML) file is validated by pydantic with unknown keys refused; CLI
overrides are dotted `key=value` pairs whose values are parsed as YAML
(`--set trainer.steps=4 --set mode=fully_async`), applied before validation.
Each component owns its config: `engine` is the union of the engine kinds'
configs keyed on `kind` (engines/configs.py), `harness` the harnesses' keyed on
`name` (harnesses/configs.py), `sandbox` a provider's own config keyed on
`provider` (checked against that provider's config class, imported by name
from the sandboxes' PROVIDER_CONFIGS), `tito` the proxy's TitoConfig. So every
bad key fails at load time, one line each, with its path and the tag that
chose the model: `engine.kv_cache_tokns: Extra inputs are not permitted (kind hf)`.
Layering: the core imports a plug-in family's config module (pydantic only),
never a plug-in.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from miles_env.cluster.config import ClusterConfig
from miles_env.cost import CostConfig
from miles_env.engines.configs import EngineConfig, HFEngineConfig
from miles_env.errors import ConfigError
from miles_env.evals.config import EvalMode, ExternalEvalConfig
from miles_env.faults import FaultsConfig
from miles_env.guards.config import GuardsConfig
from miles_env.harnesses.configs import BuiltinConfig, HarnessConfig
from miles_env.limits import LimitsOverride
from miles_env.opd import Algorithm, OPDConfig
from miles_env.queue.config import QueueConfig, SqliteQueueConfig
from miles_env.runlog import LoggingConfig
from miles_env.sandboxes.fleet_config import FleetConfig
from miles_env.tito.config import TitoConfig

__all__ = [
    "Mode",
    "RolloutConfig",
    "EvalConfig",
    "TrainSectionConfig",
    "SandboxConfig",
    "RunConfig",
    "load_config",
    "validate_config",
    "apply_overrides",
    "error_lines",
]

# a section holding one of several models -> the key that picks it
_TAGS = {"engine": "kind", "harness": "name", "sandbox": "provider", "queue": "kind"}


def _invalid(title: str, errors: list[tuple[tuple[str | int, ...], str, str, Any]]) -> ValidationError:
    """A ValidationError of (loc, type, message, input) lines, raised from a validator: pydantic
    prefixes each loc with the field being validated."""
    details = [
        InitErrorDetails(type=PydanticCustomError(kind, msg), loc=loc, input=value)
        for loc, kind, msg, value in errors
    ]
    return ValidationError.from_exception_data(title, details)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Mode(enum.StrEnum):
    SYNC = "sync"  # generate a batch of groups, train, sync weights, repeat
    FULLY_ASYNC = "fully_async"  # rollouts keep going while the trainer consumes groups (bounded staleness)


class RolloutConfig(_Strict):
    group_size: int = Field(8, ge=2, description="episodes per task per GRPO group")
    groups_per_step: int = Field(4, ge=1)
    concurrency: int = Field(16, ge=1, description="episodes running at once")
    max_staleness: int = Field(1, ge=0, description="weight versions a group may lag (fully_async)")
    episode_timeout_s: float = Field(300.0, gt=0)
    limits: LimitsOverride = Field(
        default_factory=LimitsOverride,
        description="ceilings over every task's own limits: a stricter value applies, a looser one is ignored",
    )
    tiers: list[int] | None = Field(None, description="only train on tasks whose metadata tier is listed")
    # What trains is what the policy did (trainer/groups.py, rollout.run_valid_group):
    min_valid: int | None = Field(
        None, ge=1, description="members that ended by the policy (trainer.policy_ends) a group needs to "
        "be queued: fewer, its failed members are rolled out again; None: the whole group",
    )  # fmt: skip
    reroll_attempts: int = Field(
        2, ge=0, description="rounds of rolling a group's failed members out again before it is dropped"
    )
    stale_in_baseline: bool = Field(
        False, description="a stale episode (past max_staleness) never trains; true: its reward still "
        "counts in its fresh siblings' baseline",
    )  # fmt: skip
    # Dynamic sampling (DAPO; trainer/loop.py): a group whose rewards are all equal carries no signal
    dynamic_sampling: bool = Field(
        False, description="train only groups whose rewards differ, drawing more groups (sync: rolling "
        "them out) until groups_per_step have signal; the others are counted (groups_filtered), never trained",
    )  # fmt: skip
    max_sampling_factor: float = Field(
        3.0, ge=1.0, description="dynamic_sampling draws at most ceil(this x groups_per_step) groups a "
        "step; then it trains the groups with signal it has (none: the step is skipped, logged)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _min_valid(self) -> Self:
        if self.min_valid is not None and self.min_valid > self.group_size:
            msg = f"min_valid={self.min_valid} is more than group_size={self.group_size}"
            raise _invalid("RolloutConfig", [(("min_valid",), "min_valid_too_large", msg, None)])
        return self


class EvalConfig(_Strict):
    every: int = Field(0, ge=0, description="eval every N steps (0: only before and after training)")
    split: str = "test"
    rollouts: int = Field(4, ge=1, description="episodes per eval task")
    temperature: float | None = Field(None, ge=0.0, description="None: the harness's temperature")
    tiers: list[int] | None = None
    enabled: bool = True
    # shared: on the rollout engines | dedicated: on `engine` | external: `external` on each export
    mode: EvalMode = "shared"
    engine: EngineConfig | None = Field(None, description="dedicated: the eval engine (default: the run's)")
    external: ExternalEvalConfig | None = None

    @model_validator(mode="after")
    def _mode_sections(self) -> Self:
        """`engine` belongs to dedicated, `external` to external (which needs it)."""
        if self.mode == "external" and self.external is None:
            msg = "eval.mode=external needs external.command or external.url"
            raise _invalid("EvalConfig", [(("external",), "missing_external", msg, None)])
        if self.external is not None and self.mode != "external":
            msg = f"external is read by eval.mode=external, not {self.mode}"
            raise _invalid("EvalConfig", [(("external",), "unused_external", msg, None)])
        if self.engine is not None and self.mode != "dedicated":
            msg = f"engine is read by eval.mode=dedicated, not {self.mode}"
            raise _invalid("EvalConfig", [(("engine",), "unused_engine", msg, None)])
        return self


class TrainSectionConfig(BaseModel):
    """Loop settings; any other key is the backend's own config (TrainerConfig fields), checked at build."""

    model_config = ConfigDict(extra="allow")

    backend: str = "torch"
    steps: int = Field(12, ge=1)
    checkpoint_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)

    @property
    def backend_options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class SandboxConfig(BaseModel):
    """`provider` and that provider's own config fields, flat as in YAML (`{provider: local, warm: 2}`).

    The fields are checked against the provider's config class, looked up by name in
    `miles_env.sandboxes.PROVIDER_CONFIGS` and imported then (only the named provider's config
    module, never its SDK); `config` is that validated model, `options` its fields as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    provider: str = "local"
    _config: BaseModel | None = PrivateAttr(None)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def config(self) -> BaseModel:
        assert self._config is not None  # set by the validator below
        return self._config

    @model_validator(mode="after")
    def _provider_config(self) -> Self:
        from miles_env.sandboxes import PROVIDER_CONFIGS

        if self.provider not in PROVIDER_CONFIGS.names():
            known = ", ".join(PROVIDER_CONFIGS.names())
            msg = f"{self.provider!r} is unknown; known: {known}"
            raise _invalid("SandboxConfig", [(("provider",), "unknown_provider", msg, self.provider)])
        config_cls = PROVIDER_CONFIGS.load(self.provider)
        try:
            self._config = config_cls.model_validate(self.options)
        except ValidationError as e:
            lines = [
                ((self.provider, *err["loc"]), err["type"], err["msg"], err["input"]) for err in e.errors()
            ]
            raise _invalid("SandboxConfig", lines) from None
        return self


class RunConfig(_Strict):
    run_dir: Path = Path("runs/default")
    seed: int = 0
    mode: Mode = Mode.SYNC
    env: str = "terminal-basics"
    harness: HarnessConfig = Field(default_factory=BuiltinConfig)
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    tito: TitoConfig = Field(default_factory=TitoConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainSectionConfig = Field(default_factory=TrainSectionConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    weight_sync: str = Field("in_process", pattern="^(in_process|disk|delta|delta_disk)$")
    logging: LoggingConfig = Field(default_factory=LoggingConfig)  # tensorboard, wandb
    queue: QueueConfig = Field(default_factory=SqliteQueueConfig)  # sqlite (run_dir) | redis (shared)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # address null: one process
    fleet: FleetConfig = Field(default_factory=FleetConfig)  # sandbox creation rate, cap, retries, warm
    cost: CostConfig = Field(default_factory=CostConfig)  # price table, budget_usd
    guards: GuardsConfig = Field(default_factory=GuardsConfig)  # reward-hacking detectors (miles_env/guards)
    algorithm: Algorithm = "grpo"  # opd: on-policy distillation from `opd.teacher` (miles_env/opd.py)
    opd: OPDConfig | None = None
    faults: FaultsConfig | None = None  # injected infrastructure faults (miles_env/faults.py): tests, bench
    # Written by the job into run_dir/config.yaml: the env's distribution {name, version}; not an input.
    env_dist: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _cluster_queue(self) -> Self:
        """Rollout workers on other nodes put into the queue the driver takes from: it must be shared."""
        if self.cluster.address is not None and self.queue.kind != "redis":
            msg = f"cluster.address={self.cluster.address!r} needs a shared queue: set queue.kind=redis"
            raise _invalid("RunConfig", [(("queue", "kind"), "shared_queue", msg, self.queue.kind)])
        return self

    @model_validator(mode="after")
    def _opd_section(self) -> Self:
        """algorithm=opd needs `opd` (its teacher); `opd` is read only by it; cluster workers put
        groups the driver's teacher never sees, so OPD runs in one process."""
        if self.algorithm == "opd" and self.opd is None:
            msg = "algorithm=opd needs opd.teacher (an engine config)"
            raise _invalid("RunConfig", [(("opd",), "missing_opd", msg, None)])
        if self.opd is not None and self.algorithm != "opd":
            msg = f"opd is read by algorithm=opd, not {self.algorithm}"
            raise _invalid("RunConfig", [(("opd",), "unused_opd", msg, None)])
        if self.opd is not None and self.cluster.address is not None:
            msg = "algorithm=opd runs in one process (cluster rollout workers have no teacher)"
            raise _invalid("RunConfig", [(("cluster", "address"), "opd_cluster", msg, self.cluster.address)])
        if self.opd is not None and self.rollout.dynamic_sampling:
            msg = "rollout.dynamic_sampling with algorithm=opd: the teacher's signal is in every group"
            raise _invalid("RunConfig", [(("rollout", "dynamic_sampling"), "opd_filter", msg, True)])
        return self

    @model_validator(mode="after")
    def _eval_temperature(self) -> Self:
        """eval.temperature replaces the harness's own: only a harness that samples itself has one."""
        fields = type(self.harness).model_fields
        open_ended = self.harness.model_config.get("extra") == "allow"  # framework: the adapter's options
        if self.eval.temperature is not None and "temperature" not in fields and not open_ended:
            msg = f"harness {self.harness.name!r} has no temperature to replace"
            raise _invalid(
                "RunConfig", [(("eval", "temperature"), "no_temperature", msg, self.eval.temperature)]
            )
        return self


def _parse_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:] or 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.steps=4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from e
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def error_lines(error: ValidationError) -> list[str]:
    """One line per error, `path: message`; in a section of several models the tag that chose the
    model follows (`engine.kv_cache_tokns: Extra inputs are not permitted (kind hf)`), and an
    unknown tag lists the known ones (`engine.kind: 'hff' is unknown; known: hf, sglang, ...`)."""
    lines = []
    for err in error.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"]
        tag = _TAGS.get(loc[0]) if loc else None
        if tag is not None and err["type"] == "union_tag_invalid":
            ctx = err.get("ctx") or {}
            known = str(ctx.get("expected_tags", "")).replace("'", "")
            loc, msg = [loc[0], tag], f"{ctx.get('tag')!r} is unknown; known: {known}"
        elif tag is not None and len(loc) > 1 and loc[1] != tag:
            loc, msg = [loc[0], *loc[2:]], f"{msg} ({tag} {loc[1]})"
        lines.append(f"{'.'.join(loc) or 'value'}: {msg}")
    return lines


def validate_config(data: dict[str, Any], source: str | None = None) -> RunConfig:
    """The RunConfig of `data` (a parsed file with its overrides applied); ConfigError naming each bad key."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        where = f" in {source}" if source else ""
        raise ConfigError(
            f"invalid config{where}:\n" + "\n".join(f"  {line}" for line in error_lines(e))
        ) from e


def load_config(path: Path | None, overrides: list[str] | None = None) -> RunConfig:
    data = _parse_file(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return validate_config(data, str(path) if path else None)
