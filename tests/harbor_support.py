"""A harbor task directory written from scratch, for the harbor adapter's tests.

`make_task(root, name)` lays out what Harbor expects (task.toml, instruction.md, an environment
Dockerfile with a data folder, a verifier test.sh writing /logs/verifier/reward.txt, and an oracle
solution) for the task "write 'hello harbor' to /app/out/hello.txt"; the reward is 1 only when the
file holds that line and the seeded data was copied in.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TEST_SH", "make_task"]

TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/out/hello.txt 2>/dev/null)" = "hello harbor" ] && grep -q seed /app/data/seed.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def make_task(root: Path, name: str = "hello") -> Path:
    d = root / name
    (d / "environment" / "data").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 30.0\n'
        "[agent]\ntimeout_sec = 30.0\n[environment]\nmemory_mb = 512\n"
    )
    (d / "instruction.md").write_text("Write 'hello harbor' to /app/out/hello.txt.\n")
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n")
    (d / "environment" / "data" / "seed.txt").write_text("seed\n")
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nmkdir -p /app/out\ncat /solution/msg.txt > /app/out/hello.txt\n"
    )
    (d / "solution" / "msg.txt").write_text("hello harbor\n")
    return d
