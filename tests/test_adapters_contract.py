"""Every worker-backed adapter (hud, nemo-gym, openenv, verifiers) against `AdapterContract`.

The contract runs each adapter's example environment with the framework's real
package in its own venv (installed, or reused, under MILES_ENV_CACHE). The fast
tests check the adapter family's one table, `ADAPTERS`, without any venv.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from adapter_contract import AdapterCase, AdapterContract

import miles_env.adapters as adapters_pkg
from miles_env.adapters import ADAPTERS, is_adapter_name, load_adapter_environment
from miles_env.adapters.framework_harness import FrameworkHarness
from miles_env.adapters.venv import FRAMEWORKS
from miles_env.adapters.worker_client import WORKERS_DIR
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.environment import Environment
from miles_env.errors import RegistryError
from miles_env.harness import Endpoint
from miles_env.types import Status, Task

EX = Path(adapters_pkg.__file__).parent / "examples"

CASES = [
    AdapterCase(
        adapter="hud",
        env_name=f"hud:{EX / 'hud_say_word.py'}",
        pick=lambda t: t.metadata["args"]["word"] == "river",
        reply="river it is",
        bad_name="hud:/nonexistent/miles-env/env.py",
        bad_hint="No such file or directory",
    ),
    AdapterCase(
        adapter="nemo-gym",
        env_name="nemo-gym:mcqa",
        pick=lambda t: t.metadata["idx"] == 0,  # example row 0: expected answer B
        reply="\\boxed{B}",
        bad_name="nemo-gym:no_such_server",
        bad_hint="no_such_server",
    ),
    AdapterCase(
        adapter="openenv",
        env_name=f"openenv:{EX / 'openenv_guess.py'}:app",
        pick=lambda t: t.id == "seed-1",  # seed 1 -> "river"
        reply="I say river",
        bad_name="openenv:no_such_module:app",
        bad_hint="No module named 'no_such_module'",
    ),
    AdapterCase(
        adapter="verifiers",
        env_name=f"verifiers:{EX / 'vf_say_word.py'}",
        pick=lambda t: t.id == "say-river",
        reply="river it is",
        bad_name="verifiers:no_such_taskset",
        bad_hint="no_such_taskset",
    ),
]


@pytest.mark.slow
class TestWorkerAdapters(AdapterContract):
    @pytest.fixture(params=CASES, ids=lambda c: c.adapter)
    def case(self, request: pytest.FixtureRequest) -> AdapterCase:
        from miles_env.adapters.venv import install

        install(request.param.adapter)
        return request.param  # type: ignore[no-any-return]


def test_every_worker_backed_adapter_has_a_contract_case() -> None:
    worker_backed = [n for n in ADAPTERS.names() if issubclass(ADAPTERS.load(n), WorkerEnvironment)]
    assert worker_backed == sorted(c.adapter for c in CASES) == ["hud", "nemo-gym", "openenv", "verifiers"]


@pytest.mark.parametrize("name", ADAPTERS.names())
def test_adapters_table_entries(name: str) -> None:
    """Each prefix names an Environment class with a `run_episode`, a venv spec and, if worker-backed, its script."""
    cls = ADAPTERS.load(name)
    assert issubclass(cls, Environment) and callable(cls.run_episode)
    assert name in FRAMEWORKS
    if issubclass(cls, WorkerEnvironment):
        assert cls.adapter == name and (WORKERS_DIR / cls.script).is_file()
    assert is_adapter_name(f"{name}:x") and not is_adapter_name(f"{name}:")


def test_unknown_adapter_is_a_one_line_error() -> None:
    with pytest.raises(RegistryError, match=r"adapter 'zzz' is unknown; known: harbor, hud") as e:
        load_adapter_environment("zzz:x")
    assert "\n" not in str(e.value)
    task = Task(id="t", env="zzz:x", instruction="x", metadata={"adapter": "zzz"})

    async def main() -> object:
        return await FrameworkHarness().run(task, None, Endpoint("http://127.0.0.1:9/v1", "k", "m"))  # type: ignore[arg-type]

    res = anyio.run(main)
    assert res.status is Status.FAILED and "adapter 'zzz' is unknown" in (res.error or "")  # type: ignore[attr-defined]
