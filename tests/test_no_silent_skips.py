"""Under CI=true a skip fails the run unless it is for cloud credentials or a GPU (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent
CONFTEST = (HERE / "conftest.py").read_text()
TESTS = """
import pytest
def test_docker(): pytest.skip("no docker daemon with a usable base image")
def test_cloud(): pytest.skip("e2b: credentials not set (E2B_API_KEY)")
def test_gpu(): pytest.skip("needs a GPU")
@pytest.mark.xfail(reason="known")
def test_xfail(): assert False
def test_ok(): pass
"""


def _with_our_conftest(pytester: pytest.Pytester) -> None:
    """Our conftest and the `tests` modules its hooks import, as in the repo."""
    pytester.makeconftest(CONFTEST)
    pytester.mkpydir("tests")
    for hooks_import in ("scheduling.py", "host_leftovers.py"):
        (pytester.path / "tests" / hooks_import).write_text((HERE / hooks_import).read_text())


@pytest.mark.parametrize("ci", ["true", ""])
def test_unexpected_skips_fail_only_in_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
):
    monkeypatch.setenv("CI", ci)
    _with_our_conftest(pytester)
    pytester.makepyfile(test_x=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(passed=1, failed=1, skipped=2, xfailed=1)
        result.stdout.fnmatch_lines(["*skip not allowed in CI*no docker daemon*"])
    else:
        result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_module_level_importorskip_fails_collection_in_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CI", "true")
    _with_our_conftest(pytester)
    pytester.makepyfile(
        test_y='import pytest\npytest.importorskip("no_such_module_xyz")\ndef test_a(): pass\n'
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skip not allowed in CI*no_such_module_xyz*"])
