"""Dockerfile replay on the local provider follows Docker's reference: COPY --chmod, ADD archives,
here-documents, SHELL; every instruction or flag it cannot honour is refused by name and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_env.adapters.harbor.dockerfile import Heredoc, parse_dockerfile
from tests.harbor_support import copy_task, harbor_trial_rewards, make_features_task, oracle_result


def test_parse_heredocs() -> None:
    steps = parse_dockerfile(
        "FROM a\nRUN <<EOF\necho 1\n  EOF not yet\nEOF\nCOPY <<-'A' <<B /dst/\n\tx\n\tA\ny $V\nB\n"
        'RUN ["<<EOF"]\nRUN python3 <<EOF > out\nprint(1)\nEOF\nENV X=1\n'
    )
    assert [s.op for s in steps] == ["FROM", "RUN", "COPY", "RUN", "RUN", "ENV"]
    assert steps[1].heredocs == (Heredoc("EOF", "echo 1\n  EOF not yet\n", False, True),)
    a, b = steps[2].heredocs
    assert (a.content(), a.expand, b.content(), b.expand) == ("x\n", False, "y $V\n", True)
    assert steps[3].heredocs == ()  # the exec form has no here-documents
    assert steps[4].script() == "python3 <<EOF > out\nprint(1)\nEOF" and steps[5].line == 15


@pytest.mark.parametrize(("solution", "score"), [(None, 1.0), ("true", 0.0)])  # oracle, nop
def test_dockerfile_features_replayed(tmp_path: Path, solution: str | None, score: float) -> None:
    """Before: --chmod dropped, archives copied not unpacked, heredoc bodies run as instructions."""
    res = oracle_result(make_features_task(tmp_path), solution)
    assert res.error is None, res.error
    assert res.score == score, res.details.get("test_output")


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("ADD --checksum=sha256:00 data/words.txt /app/", "Dockerfile:3: ADD --checksum is not supported"),
        ("RUN --mount=type=cache,target=/c true", "Dockerfile:3: RUN --mount is not supported"),
        ("COPY --parents data/words.txt /app/", "Dockerfile:3: COPY --parents is not supported"),
        ("COPY --exclude=*.md data/ /app/", "Dockerfile:3: COPY --exclude is not supported"),
        ("USER agent", "Dockerfile:3: USER agent is not supported by the local provider"),
        ("ADD https://example.com/x.tar.gz /app/", "Dockerfile:3: ADD of a URL is not supported"),
        ("COPY --chown=4242:4242 data/words.txt /app/w", "Dockerfile:3: COPY --chown=4242:4242 is not supp"),
        ("COPY --chmod=abc data/words.txt /app/w", "--chmod='abc' is not a file mode"),
        ("FROBNICATE now", "Dockerfile:3: FROBNICATE is not supported by the local provider"),
    ],
)
def test_refused_by_name(tmp_path: Path, line: str, expect: str) -> None:
    d = copy_task(tmp_path, f"FROM ubuntu:24.04\nWORKDIR /app\n{line}\nRUN touch /app/after\n")
    res = oracle_result(d)
    assert res.error is not None and expect in res.error, res.error
    assert "use the docker provider" in res.error or "file mode" in res.error


@pytest.mark.slow
def test_parity_with_harbors_own_trial(tmp_path: Path) -> None:
    """Harbor's own Trial (oracle, nop) on the replayed environment scores as our oracle does."""
    d = make_features_task(tmp_path)
    theirs = harbor_trial_rewards(d)
    ours = [oracle_result(d).score, oracle_result(d, "true").score]
    assert theirs == [{"reward": s} for s in ours] == [{"reward": 1.0}, {"reward": 0.0}]


@pytest.mark.parametrize("with_ignore", [True, False])
def test_dockerignore_excludes_from_the_context(tmp_path: Path, with_ignore: bool) -> None:
    d = copy_task(
        tmp_path,
        "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n"
        "RUN test ! -e /app/data/skip.log && test -f /app/data/keep.log && test -f /app/data/words.txt\n",
    )
    for name in ("skip.log", "keep.log"):
        (d / "environment" / "data" / name).write_text("x\n")
    if with_ignore:
        (d / "environment" / ".dockerignore").write_text("# logs\n**/*.log\n!data/keep.log\n")
    res = oracle_result(d)
    assert (res.error is None) == with_ignore, res.error


def test_copy_forms(tmp_path: Path) -> None:
    """The JSON form after flags, a wildcard into a folder, a file into an existing folder."""
    from tests.harbor_support import copy_task, oracle_result

    d = copy_task(
        tmp_path,
        'FROM ubuntu:24.04\nWORKDIR /app\nCOPY --chmod=700 ["data/words.txt", "/app/w x.txt"]\n'
        "RUN mkdir -p /app/dir\nCOPY data/*.txt /app/glob/\nCOPY bin/count-words /app/dir\n"
        'RUN test "$(stat -c %a "/app/w x.txt")" = 700 && test -f /app/glob/words.txt '
        "&& test -f /app/dir/count-words\n",
    )
    res = oracle_result(d)
    assert res.error is None, res.error
    (d / "environment" / "data" / "more.txt").write_text("x\n")
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nCOPY data/*.txt /app/one\n")
    res = oracle_result(d)
    assert res.error is not None and "matches several files; the destination must end in /" in res.error
