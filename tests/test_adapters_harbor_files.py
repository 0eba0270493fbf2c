"""Harbor tests/ and solution/ reach the sandbox byte for byte: binary, 5 MiB, executable bits kept."""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import pytest

from miles_env.adapters.harbor.files import EMBED_LIMIT, read_tree, upload
from miles_env.registry import load_environment
from tests.harbor_support import BINARY_SIZE, harbor_trial_rewards, make_binary_task, oracle_result


@pytest.mark.parametrize(("solution", "score"), [(None, 1.0), ("true", 0.0)])  # oracle, nop
def test_binary_large_executable_files(tmp_path: Path, solution: str | None, score: float) -> None:
    """Before: tests/fixture.bin and solution/payload.bin were dropped as non-text, the oracle scored 0."""
    res = oracle_result(make_binary_task(tmp_path), solution)
    assert res.error is None, res.error
    assert res.score == score, res.details


def test_small_binary_solution_is_embedded_in_the_script(tmp_path: Path) -> None:
    """Small enough to fit one exec argument: `task.solution` alone recreates the files (no staging)."""
    d = make_binary_task(tmp_path)
    small = bytes(range(256)) * 16
    for p in (d / "tests" / "fixture.bin", d / "solution" / "payload.bin"):
        p.write_bytes(small)
    (task,) = load_environment(f"harbor:{d}").tasks("test")
    assert task.solution is not None and len(task.solution) < EMBED_LIMIT + 4096
    res = oracle_result(d, task.solution)  # an explicit script: the oracle stages nothing
    assert res.error is None and res.score == 1.0, (res.error, res.details, res.solution_stderr)


def test_large_solution_says_why_without_staging(tmp_path: Path) -> None:
    d = make_binary_task(tmp_path)
    (task,) = load_environment(f"harbor:{d}").tasks("test")
    res = oracle_result(d, task.solution)
    assert res.score == 0.0 and "too large for a script" in res.solution_stderr


def test_upload_keeps_bytes_and_modes(tmp_path: Path) -> None:
    from miles_env.sandboxes import get_provider
    from miles_env.types import SandboxSpec

    d = make_binary_task(tmp_path)
    files = read_tree(d / "tests")
    by_name = {f.rel: f for f in files}
    assert len(by_name["fixture.bin"].data) == BINARY_SIZE + 3 and by_name["check"].mode == 0o755

    async def main() -> tuple[bytes, str]:
        async with await get_provider("local").create(SandboxSpec()) as sb:
            await upload(sb, "/tmp/t", files)
            modes = await sb.exec("stat -c '%a %n' /tmp/t/check /tmp/t/fixture.bin", timeout=30)
            return await sb.read_file("/tmp/t/fixture.bin"), modes.stdout

    data, modes = anyio.run(main)
    assert (
        hashlib.sha256(data).digest() == hashlib.sha256((d / "tests" / "fixture.bin").read_bytes()).digest()
    )
    assert modes.split()[::2] == ["755", "644"]


@pytest.mark.slow
def test_parity_with_harbors_own_trial(tmp_path: Path) -> None:
    """Harbor's Trial (its oracle and nop agents, its verifier) and ours agree on the binary task."""
    d = make_binary_task(tmp_path)
    theirs = harbor_trial_rewards(d)
    ours = [oracle_result(d).score, oracle_result(d, "true").score]
    assert theirs == [{"reward": s} for s in ours] == [{"reward": 1.0}, {"reward": 0.0}]


def test_env_validate_probes_stage_the_solution(tmp_path: Path) -> None:
    """`env validate`'s oracle probe uploads solution files too large for a script, as the oracle does."""
    from miles_env.sandboxes import get_provider
    from miles_env.validate.probes import run_probes

    env = load_environment(f"harbor:{make_binary_task(tmp_path)}")
    oracle, nop = anyio.run(run_probes, env, env.tasks("test"), get_provider("local"))
    assert [(p.scores, p.error) for p in oracle] == [((1.0, 1.0, 1.0), None)]
    assert [(p.scores, p.error) for p in nop] == [((0.0, 0.0, 0.0), None)]
