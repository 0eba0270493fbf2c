"""What the Dockerfile replay once did by hand (COPY --chmod, ADD of tar archives, here-documents,
SHELL) the real builder does: the features task passes oracle 1, nop 0 on the local provider's
build, and Harbor's own Trial scores it the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harbor_support import harbor_trial_rewards, make_features_task, oracle_result


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory, image_bases: Any) -> Path:
    return make_features_task(tmp_path_factory.mktemp("features"))


@pytest.mark.parametrize(("solution", "score"), [(None, 1.0), ("true", 0.0)])  # oracle, nop
def test_dockerfile_features_are_built(features: Path, solution: str | None, score: float) -> None:
    res = oracle_result(features, solution)
    assert res.error is None, res.error
    assert res.score == score, res.details.get("test_output")


@pytest.mark.slow
def test_parity_with_harbors_own_trial(features: Path) -> None:
    """Harbor's own Trial (oracle, nop) on the built environment scores as our oracle does."""
    theirs = harbor_trial_rewards(features)
    ours = [oracle_result(features).score, oracle_result(features, "true").score]
    assert theirs == [{"reward": s} for s in ours] == [{"reward": 1.0}, {"reward": 0.0}]
