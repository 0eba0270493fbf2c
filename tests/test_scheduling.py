"""tests/scheduling.py under a real pytest-xdist run: grouped modules share one worker, in order.

Why a subprocess run: the property lives in how xdist and pytest meet (pytest 9's node ids broke
xdist's own `--dist loadgroup`, which grouped nothing), so only a real `pytest -n 2` shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.scheduling import HEAVY_FIRST, scope_of

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
def pytest_collection_modifyitems(config, items):
    from tests.scheduling import schedule
    schedule(items)
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.scheduling import make_scheduler
    return make_scheduler(config, log)
"""
MODULE = """
import os, time
def _ran():
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}\\n")
def test_1():
    time.sleep(0.2)
    _ran()
def test_2():
    _ran()
"""


def test_scopes_map_modules_to_their_group() -> None:
    assert (
        scope_of("tests/test_cluster.py::test_x") == scope_of("tests/test_cluster_faults.py::t[a]") == "ray"
    )
    assert scope_of("tests/test_tito_chat.py::test_y") == "test_tito_chat"
    assert "ray" in HEAVY_FIRST


def test_a_group_runs_whole_on_one_worker(tmp_path: Path) -> None:
    tests, log = tmp_path / "tests", tmp_path / "ran.log"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "scheduling.py").write_text((REPO / "tests/scheduling.py").read_text())
    (tests / "conftest.py").write_text(CONFTEST)
    # The two grouped modules come first: ungrouped, xdist would hand them to the two workers at once.
    for name in ("test_cluster", "test_cluster_faults", "test_x", "test_y", "test_z"):
        (tests / f"{name}.py").write_text(MODULE)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "RAN_LOG": str(log)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ran = [line.split() for line in log.read_text().splitlines()]
    workers = {module: {w for m, w, _ in ran if m == module} for module, _, _ in ran}
    ray = workers["tests.test_cluster"] | workers["tests.test_cluster_faults"]
    assert len(ray) == 1, workers  # one worker ran both Ray modules
    order = [m for m, w, _ in sorted(ran, key=lambda x: float(x[2])) if w in ray and "cluster" in m]
    assert order == sorted(order, key=lambda m: "faults" in m), order  # one after the other, not interleaved
    assert len({w for ws in workers.values() for w in ws}) == 2  # and the rest spread
