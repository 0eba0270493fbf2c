"""A harbor task directory written from scratch, for the harbor adapter's tests.

`make_task(root, name)` lays out what Harbor expects (task.toml, instruction.md, an environment
Dockerfile with a data folder, a verifier test.sh writing /logs/verifier/reward.txt, and an oracle
solution) for the task "write 'hello harbor' to /app/out/hello.txt"; the reward is 1 only when the
file holds that line and the seeded data was copied in.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["TEST_SH", "make_task", "make_binary_task", "BINARY_SIZE"]

BINARY_SIZE = 5 * 1024 * 1024

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


BINARY_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if cmp -s /app/out.bin /tests/fixture.bin && [ "$(/tests/check)" = ok ] && [ -f /app/tool-ran ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def make_binary_task(root: Path, name: str = "binary") -> Path:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text(
        'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n'
    )
    (d / "instruction.md").write_text("Recreate the payload at /app/out.bin.\n")
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    payload = b"\xff\xfe\x00" + random.Random(7).randbytes(BINARY_SIZE)  # never valid UTF-8
    (d / "tests" / "fixture.bin").write_bytes(payload)
    (d / "solution" / "payload.bin").write_bytes(payload)
    (d / "tests" / "test.sh").write_text(BINARY_TEST_SH)
    for path, body in ((d / "tests" / "check", "echo ok"), (d / "solution" / "tool", "touch /app/tool-ran")):
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    (d / "solution" / "solve.sh").write_text(
        "#!/bin/bash\ncp /solution/payload.bin /app/out.bin\n/solution/tool\n"
    )
    return d
