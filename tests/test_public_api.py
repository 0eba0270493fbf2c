"""The public surface is deliberate: adding or removing a name must be a conscious change."""

from __future__ import annotations

import importlib

import miles_env

EXPECTED = {
    "ConfigError", "Endpoint", "EngineError", "Environment", "Episode", "ExecResult",
    "Harness", "HarnessError", "HarnessResult", "MilesEnvError", "NetworkPolicy", "RegistryError",
    "Resources", "Reward", "Sandbox", "SandboxError", "SandboxProvider", "SandboxSpec",
    "SandboxUnavailable", "Status", "Task", "TaskError", "Trajectory", "Transcript", "Turn", "__version__",
}  # fmt: skip


def test_public_names_are_locked() -> None:
    assert set(miles_env.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(miles_env, name), name


def test_every_part_imports_under_the_namespace() -> None:
    for mod in ("miles_env.sandboxes", "miles_env.tito", "miles_env.trainer", "miles_env.adapters"):
        m = importlib.import_module(mod)
        assert m.__name__ == mod
