"""Shared test configuration: offline, quiet, the `slow` marker, and no silent skips in CI."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- no silent skips --------------------------------------------------------------------------
# A fresh machine can fix everything but two things by itself: cloud credentials and a GPU. Under
# CI (CI=true) any other skip -- a missing module, binary, docker daemon or writable cgroup -- is
# an install step the scripts forgot, so it fails the run instead of hiding.
_ALLOWED_SKIP = re.compile(r"credential|api[_ ]?key|\bgpu\b|cuda", re.IGNORECASE)


def _strict_skips() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(longrepr: object) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_unexpected_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (_strict_skips() and report.skipped) or getattr(report, "wasxfail", None) is not None:
        return
    reason = _skip_reason(report.longrepr)
    if _ALLOWED_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"skip not allowed in CI (only missing credentials or GPU may skip): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())
