from __future__ import annotations

from pathlib import Path

import pytest

from miles_env.config import Mode, load_config
from miles_env.errors import ConfigError


def test_yaml_and_overrides(tmp_path: Path) -> None:
    p = tmp_path / "run.yaml"
    p.write_text("run_dir: runs/x\nseed: 3\ntrainer:\n  steps: 5\n  lr: 2.0e-5\nrollout:\n  group_size: 4\n")
    cfg = load_config(p, ["trainer.steps=2", "mode=fully_async", "seed=7", "trainer.backend=torch"])
    assert cfg.seed == 7 and cfg.mode is Mode.FULLY_ASYNC
    assert cfg.trainer.steps == 2 and cfg.trainer.backend_options == {"lr": 2.0e-5}
    assert cfg.rollout.group_size == 4 and cfg.run_dir == Path("runs/x")


def test_toml(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text('env = "terminal-hard"\n[rollout]\ngroups_per_step = 2\n')
    cfg = load_config(p)
    assert cfg.env == "terminal-hard" and cfg.rollout.groups_per_step == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_sise=4"], r"rollout.group_sise: Extra inputs are not permitted"),
        (["rollout.group_size=1"], r"rollout.group_size: Input should be greater than or equal to 2"),
        (["mode=bogus"], r"mode: Input should be 'sync' or 'fully_async'"),
        (["trainer.steps"], r"expected key=value"),
        (["seed.x=1"], r"seed: Input should be a valid integer"),
        (["seed=1", "seed.x=1"], r"'seed' is not a section"),
        (["weight_sync=carrier-pigeon"], r"weight_sync"),
    ],
)
def test_bad_config_names_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)


# -- component-owned sections: engine, harness, sandbox, tito -----------------------------------
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["engine.kv_cache_tokns=1"], "engine.kv_cache_tokns: Extra inputs are not permitted (kind hf)"),
        (["engine.kind=vllm", "engine.kv_cache_tokens=1"], "engine.kv_cache_tokens: Extra inputs"),
        (["engine.kind=sglang", "engine.timeout_s=0"], "engine.timeout_s: Input should be greater than 0"),
        (["harness.max_turn=2"], "harness.max_turn: Extra inputs are not permitted (name builtin)"),
        (["harness.name=codex", "harness.max_turns=2"], "harness.max_turns: Extra inputs are not permitted"),
        (["sandbox.warmm=2"], "sandbox.warmm: Extra inputs are not permitted (provider local)"),
        (["sandbox.provider=docker", "sandbox.cpus=0"], "sandbox.cpus: Input should be greater than 0"),
        (["tito.tool_mod=text"], "tito.tool_mod: Extra inputs are not permitted"),
        (["tito.budget.max_turns=0"], "tito.budget.max_turns: Input should be greater than or equal to 1"),
        (["queue.kind=redis", "queue.urll=x"], "queue.urll: Extra inputs are not permitted (kind redis)"),
        (["queue.kind=kafka"], "queue.kind: 'kafka' is unknown; known: sqlite, redis"),
        (
            ["eval.temperature=0.5", "harness.name=codex"],
            "eval.temperature: harness 'codex' has no temperature",
        ),
    ],
)
def test_a_bad_key_in_a_section_fails_at_load_with_its_path(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert f"  {line}" in str(info.value).splitlines()[1], str(info.value)


def test_an_unknown_kind_name_or_provider_lists_the_known_ones() -> None:
    from miles_env.engines import ENGINES
    from miles_env.harnesses import HARNESSES
    from miles_env.sandboxes import PROVIDER_CONFIGS

    for override, table in [
        ("engine.kind=tpu", ENGINES),
        ("harness.name=aider", HARNESSES),
        ("sandbox.provider=firecracker", PROVIDER_CONFIGS),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        section, _, value = override.partition("=")
        line = str(info.value).splitlines()[1]
        assert line.startswith(f"  {section}: {value!r} is unknown; known: "), line
        assert set(line.partition("known: ")[2].split(", ")) == set(table.names()), line


def test_each_union_holds_one_model_per_plugin_of_its_family() -> None:
    """A kind added to ENGINES (or a harness to HARNESSES) without its config model, or the reverse,
    would load configs that cannot be built: the two lists must be the same."""
    import typing

    from miles_env.engines import ENGINES, EngineConfig
    from miles_env.harnesses import HARNESSES
    from miles_env.harnesses.configs import HarnessConfig

    def tags(union: object, key: str) -> set[str]:
        members = typing.get_args(typing.get_args(union)[0])
        return {m.model_fields[key].default for m in members}

    assert tags(EngineConfig, "kind") == set(ENGINES.names())
    assert tags(HarnessConfig, "name") == set(HARNESSES.names())


def test_defaults_are_the_cpu_run() -> None:
    from miles_env.engines import HFEngineConfig
    from miles_env.harnesses.configs import BuiltinConfig
    from miles_env.sandboxes.local import LocalSandboxConfig
    from miles_env.tito.config import TitoConfig

    cfg = load_config(None)
    assert cfg.engine == HFEngineConfig() and cfg.engine.model == "smollm2"
    assert cfg.harness == BuiltinConfig() and cfg.sandbox.provider == "local" and cfg.sandbox.options == {}
    assert cfg.sandbox.config == LocalSandboxConfig() and cfg.tito == TitoConfig()
    # a section without its tag is the default kind, with the fields given
    cfg = load_config(None, ["engine.dtype=float32", "harness.max_turns=2", "sandbox.warm=0"])
    assert isinstance(cfg.engine, HFEngineConfig) and cfg.engine.dtype == "float32"
    assert isinstance(cfg.harness, BuiltinConfig) and cfg.harness.max_turns == 2
    assert cfg.sandbox.config == LocalSandboxConfig(warm=0) and cfg.sandbox.options == {"warm": 0}


def test_every_example_config_loads() -> None:
    import yaml

    examples = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        cfg = load_config(path)
        assert set(yaml.safe_load(path.read_text())) <= cfg.model_fields_set, path


def test_set_switches_the_engine_kind_of_an_example(tmp_path: Path) -> None:
    from miles_env.engines import SGLangEngineConfig

    sets = ["engine.kind=sglang", "engine.url=http://127.0.0.1:30000"]
    cfg = load_config(ROOT / "examples" / "terminal-cpu.yaml", sets)
    assert isinstance(cfg.engine, SGLangEngineConfig)
    assert cfg.engine.url == "http://127.0.0.1:30000" and cfg.engine.dtype == "float32"  # the file's dtype
    with pytest.raises(ConfigError, match=r"engine.device: Extra inputs are not permitted \(kind sglang\)"):
        load_config(ROOT / "examples" / "terminal-cpu.yaml", [*sets, "engine.device=cpu"])


def test_the_resolved_config_loads_back_the_same(tmp_path: Path) -> None:
    """train writes RUN_DIR/config.yaml from the validated config; it must load back unchanged."""
    import json

    import yaml

    sets = ["engine.kind=vllm", "engine.nice=5", "harness.name=framework", "harness.agent=oracle"]
    cfg = load_config(ROOT / "examples" / "terminal-cpu.yaml", [*sets, "sandbox.warm=1"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    again = load_config(path)
    assert again == cfg and again.sandbox.config == cfg.sandbox.config
    assert again.harness.model_extra == {
        "agent": "oracle",
        "max_turns": 2,
        "max_tokens": 40,
        "temperature": 1.0,
    }


def test_importing_the_run_config_imports_no_plugin() -> None:
    """INVARIANTS.md layering: the core imports a family's config module, never a plug-in or its SDK."""
    import subprocess
    import sys

    heavy = ["torch", "transformers", "docker", "e2b", "daytona", "modal", "openai", "anthropic"]
    plugins = ["miles_env.sandboxes.local", "miles_env.sandboxes.docker", "miles_env.adapters"]
    plugins += [f"miles_env.engines.{m}" for m in ("hf", "sglang", "vllm", "scripted", "builders")]
    plugins += [f"miles_env.harnesses.{m}" for m in ("builtin", "claude_code", "codex", "opencode")]
    code = f"import sys, miles_env.config; print([m for m in {heavy + plugins!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_default_run_config_builds_smollm2_builtin_and_local() -> None:
    from miles_env.engines import build_engine
    from miles_env.engines.hf import HFEngine
    from miles_env.harnesses import build_harness
    from miles_env.harnesses.builtin import BuiltinHarness
    from miles_env.sandboxes import get_provider

    cfg = load_config(None)
    harness = build_harness(cfg.harness)
    assert isinstance(harness, BuiltinHarness) and harness.config == cfg.harness
    assert get_provider(cfg.sandbox.provider, **cfg.sandbox.options).name == "local"
    engine = await build_engine(cfg.engine)
    try:
        assert isinstance(engine, HFEngine) and (await engine.info()).name == "hf"
        assert engine.config.model == "smollm2" and engine.config is cfg.engine
    finally:
        await engine.close()
