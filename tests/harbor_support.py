"""A harbor task directory written from scratch, for the harbor adapter's tests.

`make_task(root, name)` lays out what Harbor expects (task.toml, instruction.md, an environment
Dockerfile with a data folder, a verifier test.sh writing /logs/verifier/reward.txt, and an oracle
solution) for the task "write 'hello harbor' to /app/out/hello.txt"; the reward is 1 only when the
file holds that line and the seeded data was copied in.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import anyio

__all__ = [
    "TEST_SH",
    "TMUX_DOCKERFILE",
    "make_task",
    "make_binary_task",
    "make_features_task",
    "BINARY_SIZE",
    "SETUP_STEPS",
    "copy_task",
    "harbor_trial_rewards",
    "oracle_result",
]

BINARY_SIZE = 5 * 1024 * 1024
SETUP_STEPS = Path(__file__).resolve().parents[1] / "adapters" / "examples" / "harbor_tasks" / "setup_steps"


def copy_task(tmp_path: Path, dockerfile: str | None = None) -> Path:
    """A copy of the `setup_steps` example task, its Dockerfile replaced when one is given."""
    d = tmp_path / "setup_steps"
    shutil.copytree(SETUP_STEPS, d)
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    return d


TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/out/hello.txt 2>/dev/null)" = "hello harbor" ] && grep -q seed /app/data/seed.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


DOCKERFILE = "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n"
# What terminus-2 drives: its tmux, carried by the image (harbor installs it at agent setup, from
# the network that an offline sandbox does not have).
TMUX_DOCKERFILE = (
    "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y --no-install-recommends tmux"
    " && rm -rf /var/lib/apt/lists/*\nWORKDIR /app\nCOPY data/ /app/data/\n"
)


def make_task(root: Path, name: str = "hello", dockerfile: str = DOCKERFILE) -> Path:
    d = root / name
    (d / "environment" / "data").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 30.0\n'
        "[agent]\ntimeout_sec = 30.0\n[environment]\nmemory_mb = 512\n"
    )
    (d / "instruction.md").write_text("Write 'hello harbor' to /app/out/hello.txt.\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
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


FEATURES_DOCKERFILE = """# syntax=docker/dockerfile:1
FROM ubuntu:24.04
ARG GREETING=hi
ENV APP=/app
WORKDIR /app
COPY --chmod=755 bin/tool.sh bin/tool
COPY --chmod=640 --link data/secret.txt secret.txt
COPY bin/keep.sh bin/
ADD pkg.tar.gz pkg/
ADD pkg.tar.bz2 bz/
ADD pkg.tar.xz xz/
ADD bundle.data plain/
ADD note.txt.gz ./
RUN <<EOF
echo "one $APP" > h1.txt
echo two >> h1.txt
EOF
RUN <<EOF
#!/usr/bin/env bash
[[ -n "$BASH_VERSION" ]] && echo "from bash" > /app/h2.txt
EOF
RUN cat <<EOF > h3.txt && echo after >> h3.txt
$GREETING from heredoc
EOF
RUN <<-EOF
\techo tabbed > h4.txt
\tEOF
COPY <<EOF conf.txt
greeting=${GREETING}
EOF
COPY <<"EOF" raw.txt
greeting=${GREETING}
EOF
SHELL ["/bin/bash", "-c"]
RUN [[ -x bin/tool ]] && echo bash > shell.txt
USER root
CMD ["bash"]
"""

FEATURES_TEST_SH = """#!/bin/bash
cd /app
ok=1
check() { if ! eval "$1"; then echo "FAILED: $1"; ok=0; fi; }
check '[ "$(bin/tool)" = "tool ok" ]'
check '[ "$(stat -c %a secret.txt)" = 640 ] && [ "$(stat -c %a bin/keep.sh)" = 750 ]'
check '[ "$(cat pkg/lib/a.txt bz/lib/a.txt xz/lib/a.txt plain/lib/a.txt)" = "$(printf "a\\na\\na\\na")" ]'
check '[ "$(stat -c %a pkg/lib/run.sh)" = 755 ] && [ ! -e pkg.tar.gz ]'
check '[ "$(gzip -dc note.txt.gz)" = "just a gzip" ]'
check '[ "$(cat h1.txt)" = "$(printf "one /app\\ntwo")" ] && [ "$(cat h2.txt)" = "from bash" ]'
check '[ "$(cat h3.txt)" = "$(printf "hi from heredoc\\nafter")" ] && [ "$(cat h4.txt)" = tabbed ]'
check '[ "$(cat conf.txt)" = "greeting=hi" ] && [ "$(cat raw.txt)" = "greeting=\\${GREETING}" ]'
check '[ "$(cat shell.txt)" = bash ] && [ -f done ]'
mkdir -p /logs/verifier
echo $ok > /logs/verifier/reward.txt
"""


def _tar(path: Path, mode: str, members: Path) -> None:
    import tarfile

    with tarfile.open(path, mode) as tf:
        tf.add(members, arcname="lib")


def make_features_task(root: Path, name: str = "features") -> Path:
    """A task whose environment needs COPY --chmod, ADD archive unpacking, heredocs and SHELL."""
    import gzip

    d = root / name
    env = d / "environment"
    for sub in ("bin", "data", "src/lib"):
        (env / sub).mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n')
    (d / "instruction.md").write_text("Create /app/done.\n")
    (env / "Dockerfile").write_text(FEATURES_DOCKERFILE)
    (env / "bin" / "tool.sh").write_text("#!/bin/sh\necho tool ok\n")  # 644 here: --chmod makes it 755
    (env / "bin" / "keep.sh").write_text("#!/bin/sh\n")
    (env / "bin" / "keep.sh").chmod(0o750)
    (env / "data" / "secret.txt").write_text("s3cret\n")
    (env / "src" / "lib" / "a.txt").write_text("a\n")
    (env / "src" / "lib" / "run.sh").write_text("#!/bin/sh\n")
    (env / "src" / "lib" / "run.sh").chmod(0o755)
    for archive, mode in (("pkg.tar.gz", "w:gz"), ("pkg.tar.bz2", "w:bz2"), ("pkg.tar.xz", "w:xz")):
        _tar(env / archive, mode, env / "src" / "lib")
    _tar(env / "bundle.data", "w", env / "src" / "lib")  # a plain tar, recognised by content
    (env / "note.txt.gz").write_bytes(gzip.compress(b"just a gzip\n"))  # not a tar: copied as is
    (d / "tests" / "test.sh").write_text(FEATURES_TEST_SH)
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\ntouch /app/done\n")
    return d


def oracle_result(task_dir: Path, solution: str | None = None) -> Any:
    """Our oracle (or `solution`, e.g. "true" for a do-nothing agent) on a harbor task directory,
    through the registry and the real local provider: an OracleResult."""
    from miles_env.oracle import run_solution
    from miles_env.registry import load_environment
    from miles_env.sandboxes import get_provider

    env = load_environment(f"harbor:{task_dir}")
    (task,) = env.tasks("test")
    return anyio.run(run_solution, env, task, get_provider("local"), solution)


def harbor_trial_rewards(task_dir: Path) -> list[Any]:
    """Harbor's own Trial (its venv, its oracle then nop agent, its verifier) on the local provider:
    each trial's `rewards`."""
    from miles_env.adapters.harbor import run_harbor_trial
    from miles_env.adapters.venv import install
    from miles_env.adapters.worker_pool import close_workers
    from miles_env.sandboxes import get_provider

    install("harbor")

    async def main() -> list[Any]:
        out = [await run_harbor_trial(task_dir, agent, get_provider("local")) for agent in ("oracle", "nop")]
        await close_workers()
        return [t["rewards"] for t in out]

    return anyio.run(main)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        if rel.endswith(".sh"):
            (root / rel).chmod(0o755)
    return root


REWARD_IF = "mkdir -p /logs/verifier; if {cond}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"


def make_steps_task(root: Path, name: str = "steps", strategy: str | None = None) -> Path:
    """A three-step task in Harbor's `[[steps]]` layout: `write` creates notes.txt, `extend` gets
    a config from its workdir/ (placed and run by setup.sh) and appends from it, `audit` must not
    see earlier tests and writes audit.txt. Each step's own test checks its step; the shared
    tests/ folder carries a helper every step's test uses. Step `write` gates at min_reward 1."""
    head = f'multi_step_reward_strategy = "{strategy}"\n' if strategy else ""
    toml = head + (
        'schema_version = "1.1"\n[agent]\ntimeout_sec = 40.0\n[environment]\nmemory_mb = 512\n'
        '[[steps]]\nname = "write"\nmin_reward = 1.0\n'
        '[[steps]]\nname = "extend"\n[steps.agent]\ntimeout_sec = 20.0\n[steps.verifier]\ntimeout_sec = 30.0\n'
        '[steps.verifier.env]\nWANT = "two"\n'
        '[[steps]]\nname = "audit"\n[steps.healthcheck]\ncommand = "test -d /app"\ninterval_sec = 0.2\n'
    )
    check = "grep -qx 'one' /app/notes.txt"
    return _write(root / name, {
        "task.toml": toml,
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
        "tests/helpers.sh": "has() { grep -qx \"$1\" /app/notes.txt; }\n",
        "steps/write/instruction.md": "Write 'one' to /app/notes.txt.\n",
        "steps/write/solution/solve.sh": "#!/bin/bash\necho one > /app/notes.txt\n",
        "steps/write/tests/test.sh": ". /tests/helpers.sh\n" + REWARD_IF.format(cond="has one"),
        "steps/extend/instruction.md": "Append the word in /app/extra.cfg to /app/notes.txt.\n",
        "steps/extend/workdir/setup.sh": "#!/bin/bash\ncp extra.in extra.cfg && rm extra.in\n",
        "steps/extend/workdir/extra.in": "two\n",
        "steps/extend/solution/solve.sh": "#!/bin/bash\ncat /app/extra.cfg >> /app/notes.txt\n",
        "steps/extend/tests/test.sh": ". /tests/helpers.sh\n" + REWARD_IF.format(cond=f'{check} && has "$WANT"'),
        "steps/audit/instruction.md": "Write 'clean' to /app/audit.txt if no test file is in sight.\n",
        "steps/audit/solution/solve.sh": "#!/bin/bash\n[ -e /tests ] || echo clean > /app/audit.txt\n",
        "steps/audit/tests/test.sh": REWARD_IF.format(cond="grep -qx clean /app/audit.txt"),
    })  # fmt: skip


def make_env_task(root: Path, name: str = "envs") -> Path:
    """A task whose task.toml sets [environment.env], [verifier.env] (a ${VAR:-default} template),
    [solution.env] and [environment].workdir; solve.sh and test.sh record what each phase saw."""
    toml = (
        '[environment]\nworkdir = "/srv/work"\n[environment.env]\nSHARED = "everywhere"\n'
        '[verifier.env]\nVERDICT = "${MILES_TEST_VERDICT:-from-default}"\n'
        '[solution.env]\nSECRET = "solution-only"\n'
    )
    seen = '"$SHARED|${SECRET:-}|${VERDICT:-}|$(pwd)"'
    return _write(root / name, {
        "task.toml": toml,
        "instruction.md": "Record the environment.\n",
        "environment/Dockerfile": "FROM ubuntu:24.04\nRUN mkdir -p /srv/work\n",  # no WORKDIR: task.toml's
        "solution/solve.sh": f"#!/bin/bash\necho {seen} > /srv/work/solution-saw\n",
        "tests/test.sh": "cd /srv/work 2>/dev/null; echo " + seen + " > verifier-saw\n" + REWARD_IF.format(
            cond='[ "$(cat solution-saw)" = "everywhere|solution-only||/srv/work" ] && '
                 '[ "$(cat verifier-saw)" = "everywhere||from-default|/srv/work" ]'),
    })  # fmt: skip


# -- tasks in the shapes of public Terminal-Bench 2 tasks, on real images (tests/test_harbor_images.py) --

WORLD_DOCKERFILE = """\
FROM ubuntu:24.04
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev python3 python3-pip \\
    && rm -rf /var/lib/apt/lists/*
RUN pip install --break-system-packages --no-cache-dir six==1.17.0
RUN useradd -m -u 1234 -s /bin/bash agent && mkdir -p /app /var/log/app && chown agent /app /var/log/app
COPY data/ /app/data/
WORKDIR /app
USER agent
"""

# The official Terminal-Bench 2.x verifier, unchanged: it installs curl, uv and its pytest set when it runs.
STOCK_TEST_SH = """\
#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

_WORLD: dict[str, dict[str, str]] = {
    "c-sum": {
        "instruction.md": "Write /app/sum.c, a C program printing the sum of the numbers in /app/data/nums.txt, "
        "and compile it to /app/sum.\n",
        "solution/solve.sh": "#!/bin/bash\ncat > /app/sum.c <<'EOF'\n#include <stdio.h>\nint main(void) {\n"
        '  FILE *f = fopen("/app/data/nums.txt", "r"); long s = 0, x;\n'
        '  while (fscanf(f, "%ld", &x) == 1) s += x;\n  printf("%ld\\n", s); return 0;\n}\nEOF\n'
        "gcc -O2 -o /app/sum /app/sum.c\n",
        "tests/test_outputs.py": "import subprocess\nimport sys\n\n\ndef test_sum():\n"
        "    assert sys.version_info[:2] == (3, 13)  # the verifier's `uvx -p 3.13`, provisioned offline\n"
        "    assert open('/app/sum', 'rb').read(4) == b'\\x7fELF'\n"
        "    assert subprocess.run(['/app/sum'], capture_output=True, text=True).stdout == '60\\n'\n",
    },
    "http-service": {
        "instruction.md": "Serve /app/data over HTTP on port 8080 and leave the server running.\n",
        "solution/solve.sh": "#!/bin/bash\ncd /app/data && nohup python3 -m http.server 8080 >/dev/null 2>&1 &\n"
        "for _ in $(seq 50); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8080))' "
        "2>/dev/null && exit 0; sleep 0.2; done\n",
        "tests/test_outputs.py": "import urllib.request\n\n\ndef test_served():\n"
        "    body = urllib.request.urlopen('http://127.0.0.1:8080/nums.txt', timeout=5).read()\n"
        "    assert body == open('/app/data/nums.txt', 'rb').read()\n",
    },
    "user-home": {
        "instruction.md": "Record the version of the six package in ~/.config/app/six.txt and log a line to "
        "/var/log/app/run.log.\n",
        "solution/solve.sh": "#!/bin/bash\nmkdir -p ~/.config/app\n"
        "python3 -c 'import six; print(six.__version__)' > ~/.config/app/six.txt\necho ran >> /var/log/app/run.log\n",
        "tests/test_outputs.py": "import os\nfrom pathlib import Path\n\n\ndef test_home():\n"
        "    assert os.getuid() == 1234 and str(Path.home()) == '/home/agent'\n"
        "    assert (Path.home() / '.config/app/six.txt').read_text() == '1.17.0\\n'\n"
        "    assert Path('/var/log/app/run.log').read_text() == 'ran\\n'\n",
    },
}


def make_world_tasks(root: Path) -> Path:
    """Four tasks sharing one environment (one image build per provider) and the stock verifier:
    a C build, a service left running for the verifier, the image's non-root USER with its HOME
    (and six from a `pip install` in RUN), and a two-step task."""
    for name, files in _WORLD.items():
        _write(root / name, {
            "task.toml": 'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[environment]\nmemory_mb = 1024\n',
            "environment/Dockerfile": WORLD_DOCKERFILE, "environment/data/nums.txt": "10 20 30\n",
            "tests/test.sh": STOCK_TEST_SH, **files,
        })  # fmt: skip
    step_test = "from pathlib import Path\n\n\ndef test_notes():\n    assert Path('/app/notes.txt').read_text() == {!r}\n"
    _write(root / "two-steps", {
        "task.toml": '[[steps]]\nname = "first"\nmin_reward = 1.0\n[[steps]]\nname = "second"\n',
        "environment/Dockerfile": WORLD_DOCKERFILE, "environment/data/nums.txt": "10 20 30\n",
        "tests/test.sh": STOCK_TEST_SH,
        "steps/first/instruction.md": "Write 'a' to /app/notes.txt.\n",
        "steps/first/solution/solve.sh": "#!/bin/bash\necho a > /app/notes.txt\n",
        "steps/first/tests/test_outputs.py": step_test.format("a\n"),
        "steps/second/instruction.md": "Append 'b' to /app/notes.txt.\n",
        "steps/second/solution/solve.sh": "#!/bin/bash\necho b >> /app/notes.txt\n",
        "steps/second/tests/test_outputs.py": step_test.format("a\nb\n"),
    })  # fmt: skip
    return root


def make_older_glibc_task(root: Path, name: str = "older-glibc") -> Path:
    """A Debian bookworm task (glibc 2.36) whose verifier asks `uvx -p 3.12`: bookworm's apt has no
    3.12 and Ubuntu noble's packages need glibc 2.38, so only a portable CPython (its own glibc)
    runs there; the test checks the version, `ssl`, and that a program it starts runs on the
    image's own libraries."""
    test = (
        "import ssl\nimport subprocess\nimport sys\n\n\ndef test_python():\n"
        "    assert sys.version_info[:2] == (3, 12) and ssl.OPENSSL_VERSION.startswith('OpenSSL 3')\n"
        "    libc = subprocess.run(['ldd', '--version'], capture_output=True, text=True).stdout\n"
        "    assert '2.36' in libc.splitlines()[0]  # the image's glibc, not the interpreter's\n"
        "    assert open('/app/out.txt').read() == 'done\\n'\n"
    )
    return _write(root / name, {
        "task.toml": 'version = "1.0"\n[agent]\ntimeout_sec = 60.0\n',
        "instruction.md": "Write 'done' to /app/out.txt.\n",
        "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
        "solution/solve.sh": "#!/bin/bash\necho done > /app/out.txt\n",
        "tests/test.sh": "#!/bin/bash\ncurl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\n"
        "source $HOME/.local/bin/env\nuvx -p 3.12 -w pytest==8.4.1 pytest /tests/test_outputs.py -rA\n"
        "[ $? -eq 0 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        "tests/test_outputs.py": test,
    })  # fmt: skip


SIDECAR_COMPOSE = """\
services:
  main:
    depends_on:
      kv:
        condition: service_healthy
  kv:
    build:
      context: ./kv
    healthcheck:
      test: ["CMD-SHELL", "perl -MIO::Socket::INET -e 'exit !IO::Socket::INET->new(q(127.0.0.1:7000))'"]
      interval: 1s
"""
# A one-line HTTP server in perl-base (in every Debian image), answering every request with "kv-ok".
KV_SERVER = (
    'FROM debian:trixie\nCMD ["perl", "-MIO::Socket::INET", "-e", '
    '"my $s = IO::Socket::INET->new(LocalAddr => q(127.0.0.1:7000), Listen => 5, ReuseAddr => 1) or die; '
    'while (my $c = $s->accept) { <$c>; print $c qq(HTTP/1.0 200 OK\\r\\n\\r\\nkv-ok); close $c }"]\n'
)


def make_sidecar_task(root: Path) -> Path:
    """A task whose solution talks to a compose sidecar by its service name (docker provider)."""
    return _write(root / "sidecar", {
        "task.toml": 'version = "1.0"\n',
        "instruction.md": "Save what http://kv:7000/ answers to /app/kv.txt.\n",
        "environment/Dockerfile": WORLD_DOCKERFILE, "environment/data/nums.txt": "10 20 30\n",
        "environment/docker-compose.yaml": SIDECAR_COMPOSE, "environment/kv/Dockerfile": KV_SERVER,
        "tests/test.sh": STOCK_TEST_SH,
        "solution/solve.sh": "#!/bin/bash\npython3 -c \"import urllib.request; "
        "open('/app/kv.txt', 'wb').write(urllib.request.urlopen('http://kv:7000/').read())\"\n",
        "tests/test_outputs.py": "def test_kv():\n    assert open('/app/kv.txt').read() == 'kv-ok'\n",
    })  # fmt: skip
