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
