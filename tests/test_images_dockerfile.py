"""Task images without building: references, the Dockerfile's images and lowering, resolution errors.

Fast (no build, no bootstrap): what a Dockerfile pulls (ARG defaults, stages, COPY --from), how
BuildKit's here-documents reach builders that do not parse them (checked against what BuildKit
runs), how references normalize, and the one-line errors for a base that cannot be had: pinned
by digest (never substituted), private (not in any registry), both naming the two remedies; a
build whose failing step could not reach a host names that host.
The cloud providers' build-context handoff is checked against the real SDKs' Image classes.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from miles_env.errors import ConfigError
from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.dockerfile import parse_dockerfile
from miles_env.sandboxes.images.errors import BaseUnavailable, unreached
from miles_env.sandboxes.images.refs import parse_ref
from miles_env.sandboxes.images.resolve import Resolver
from miles_env.sandboxes.images.tools import SkopeoProbe
from miles_env.types import SandboxSpec

MULTI = """\
# syntax=docker/dockerfile:1
ARG PY=3.12
FROM --platform=linux/amd64 python:${PY}-slim AS build
RUN pip install \\
    six
COPY --from=ghcr.io/astral-sh/uv:0.9.5 /uv /bin/
FROM build AS test
FROM ubuntu:24.04
COPY --from=build /x /y
COPY --from=0 /x /z
COPY --link a.txt /a
"""


def test_external_images_skip_stages_and_expand_global_args() -> None:
    df = parse_dockerfile(MULTI)
    assert df.external_images() == ["python:3.12-slim", "ghcr.io/astral-sh/uv:0.9.5", "ubuntu:24.04"]
    df.point_images(
        {"python:3.12-slim": "base/a", "ghcr.io/astral-sh/uv:0.9.5": "base/b", "ubuntu:24.04": "c"}
    )
    df.lower()
    out = df.render()
    assert "FROM --platform=linux/amd64 base/a AS build\n" in out and "COPY --from=base/b /uv /bin/" in out
    assert "FROM build AS test\n" in out and "FROM c\n" in out and "COPY --from=build /x /y" in out
    assert "COPY a.txt /a\n" in out  # --link: a layering hint the builders here reject
    assert "RUN pip install \\\n    six\n" in out  # untouched instructions pass byte for byte


HEREDOCS = """\
FROM debian:bookworm
ENV NAME=world
RUN <<EOF
apt-get update
echo $NAME
EOF
RUN <<'PY'
#!/usr/bin/env python3
print("hi")
PY
RUN cat > /etc/x <<-EOT && echo done
\tline1
\tEOT
COPY <<EOF /etc/greeting
hello ${NAME}
EOF
COPY <<'RAW' /etc/raw
$NAME stays
RAW
SHELL ["/bin/bash", "-c"]
RUN <<EOF
echo bash
EOF
"""


def test_heredocs_lowered_as_buildkit_runs_them() -> None:
    df = parse_dockerfile(HEREDOCS)
    extra = df.lower()
    runs = [json.loads(i.args) for i in df.instructions if i.op == "RUN"]
    # A lone here-document: its body under the shell; with #!, a file run directly.
    assert runs[0] == ["/bin/sh", "-c", "apt-get update\necho $NAME\n"]
    assert runs[1][:2] == ["/bin/sh", "-c"] and runs[1][3:] == ["sh", '#!/usr/bin/env python3\nprint("hi")\n']
    # Any other form: the command line and the bodies to the shell, which reads the heredoc itself.
    assert runs[2] == ["/bin/sh", "-c", "cat > /etc/x <<-EOT && echo done\n\tline1\nEOT"]
    assert runs[3] == ["/bin/bash", "-c", "echo bash\n"]  # SHELL applies
    # COPY heredocs become context files; an unquoted delimiter expands the stage's ENV.
    assert sorted(extra.values()) == [b"$NAME stays\n", b"hello world\n"]
    copies = [i.args for i in df.instructions if i.op == "COPY"]
    assert all(a.startswith(".miles-env-heredoc/") for a in copies), copies


def test_an_unclosed_heredoc_names_its_line() -> None:
    with pytest.raises(ConfigError, match="line 2: here-document <<EOF is never closed"):
        parse_dockerfile("FROM debian:bookworm\nRUN <<EOF\necho\n")


@pytest.mark.parametrize(
    ("text", "full", "familiar"),
    [
        ("ubuntu", "docker.io/library/ubuntu:latest", "ubuntu:latest"),
        ("ubuntu:24.04", "docker.io/library/ubuntu:24.04", "ubuntu:24.04"),
        (
            "public.ecr.aws/docker/library/golang:1.22-bookworm",
            "docker.io/library/golang:1.22-bookworm",
            None,
        ),
        ("ghcr.io/astral-sh/uv:0.9.5", "ghcr.io/astral-sh/uv:0.9.5", "ghcr.io/astral-sh/uv:0.9.5"),
        ("localhost:5000/team/img", "localhost:5000/team/img:latest", None),
        ("python@sha256:" + "a" * 64, "docker.io/library/python@sha256:" + "a" * 64, None),
    ],
)
def test_references_normalize_as_docker_does(text: str, full: str, familiar: str | None) -> None:
    ref = parse_ref(text)
    assert ref.full == full
    if familiar is not None:
        assert ref.familiar == familiar


def test_a_digest_pinned_base_is_refused_by_name_with_both_remedies() -> None:
    pinned = "python:3.12-slim@sha256:" + "c" * 64
    resolver = Resolver(ImagesConfig(), SkopeoProbe(20))
    with pytest.raises(BaseUnavailable) as e:
        resolver.resolve(pinned)
    msg = str(e.value)
    assert "\n" not in msg and pinned in msg and "pinned by digest: never substituted" in msg
    assert "tag and digest" not in msg  # looked up by its digest, as Docker does
    assert "MILES_ENV_REGISTRY_MIRROR" in msg and "MILES_ENV_IMAGE_ALIASES" in msg


def test_a_private_base_names_itself_and_both_remedies() -> None:
    resolver = Resolver(ImagesConfig(), SkopeoProbe(20))
    with pytest.raises(BaseUnavailable) as e:
        resolver.resolve("harbor-agents-rich:latest")
    msg = str(e.value)
    assert "\n" not in msg and "'harbor-agents-rich:latest' cannot be had here" in msg
    assert "docker.io:" in msg  # what was tried, and why it failed
    assert (
        "mirror" in msg
        and "alias" in msg
        and "MILES_ENV_IMAGE_ALIASES='harbor-agents-rich:latest=IMAGE'" in msg
    )


# The failing step's own lines, as buildah (interleaved) and dockerd print them; an earlier step's
# swallowed `curl ... | sh` (it exits 0) names a host too, and is not the cause.
_KOTLIN = """\
STEP 5/9: RUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh
curl: (6) Could not resolve host: astral.sh
STEP 9/9: RUN curl -fsSL https://github.com/JetBrains/kotlin/releases/download/v1.9.22/k.zip -o /tmp/k.zip
curl: (6) Could not resolve host: github.com
Error: building at STEP "RUN curl -fsSL ...": while running runtime: exit status 6
"""


@pytest.mark.parametrize(
    ("log", "host"),
    [
        (_KOTLIN, "github.com"),
        ("Step 3/4 : RUN go mod download\ngo: example.com/m@v1: Get \"https://proxy.golang.org/x\": "
         "dial tcp: lookup proxy.golang.org on 10.0.0.2:53: no such host\n", "proxy.golang.org"),
        ("STEP 2/2: RUN wget -q https://dl.example.org/a.tgz\n"
         "wget: unable to resolve host address 'dl.example.org'\n", "dl.example.org"),
        ("STEP 2/2: RUN apt-get update\nW: Failed to fetch http://x/InRelease  "
         "Temporary failure resolving 'deb.example.org'\n", "deb.example.org"),
        ("STEP 1/2: RUN pip install six\nWARNING: Retrying ... NewConnectionError('Failed to establish "
         "a new connection: [Errno -3] Temporary failure in name resolution')\n", "a host"),
        ("STEP 5/9: RUN curl -LsSf https://astral.sh/uv/install.sh | sh\ncurl: (6) Could not resolve "
         "host: astral.sh\nSTEP 6/9: RUN make\nmain.c:1: error: expected ';'\n", None),
    ],
)  # fmt: skip
def test_a_build_that_cannot_reach_a_host_names_it(log: str, host: str | None) -> None:
    why = unreached(log)
    if host is None:
        assert why is None  # a compile error after an earlier, swallowed download: not the network
    else:
        assert why == f"a RUN step needs {host}, which this machine does not reach (no route or name)"


def test_config_reads_mirrors_and_aliases_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENV_REGISTRY_MIRROR", "http://mirror.corp:5000/hub,ghcr.io=ghcr-mirror.corp")
    monkeypatch.setenv("MILES_ENV_IMAGE_ALIASES", "team/base:1=debian:bookworm")
    cfg = ImagesConfig(mirrors={"ghcr.io": "mine.corp"})
    table = cfg.mirror_table()
    assert (table["docker.io"].host, table["docker.io"].prefix, table["docker.io"].insecure) == (
        "mirror.corp:5000",
        "hub",
        True,
    )
    assert table["ghcr.io"].host == "mine.corp"  # the config's own entry wins
    assert cfg.alias_table() == {"team/base:1": "debian:bookworm"}


def _context(tmp_path: Path) -> Path:
    (tmp_path / "Dockerfile").write_text("FROM ubuntu:24.04\nCOPY data.txt /app/\n")
    (tmp_path / "data.txt").write_text("x")
    return tmp_path


def test_daytona_gets_the_build_context_through_its_real_image_class(tmp_path: Path) -> None:
    import daytona

    from miles_env.sandboxes.daytona import DaytonaSandboxConfig, DaytonaSandboxProvider

    p = DaytonaSandboxProvider(DaytonaSandboxConfig(api_key="k"), sdk=daytona)
    params = p.adapter.create_params(SandboxSpec(build=str(_context(tmp_path))), {})
    assert isinstance(params, daytona.CreateSandboxFromImageParams)
    assert isinstance(params.image, daytona.Image) and "COPY data.txt /app/" in params.image.dockerfile()
    assert [Path(c.source_path).name for c in params.image._context_list] == ["data.txt"]


def test_modal_gets_the_build_context_bound_to_its_real_signature(tmp_path: Path) -> None:
    import modal

    from miles_env.sandboxes.modal import ModalSandboxConfig, ModalSandboxProvider

    calls: list[inspect.BoundArguments] = []

    class Image:
        @staticmethod
        def from_dockerfile(*args: object, **kwargs: object) -> str:
            calls.append(inspect.signature(modal.Image.from_dockerfile).bind(*args, **kwargs))
            return "built"

    ctx = _context(tmp_path)
    p = ModalSandboxProvider(ModalSandboxConfig(), sdk=type("sdk", (), {"Image": Image}))
    assert p.adapter.create_params(SandboxSpec(build=str(ctx)))["image"] == "built"
    assert calls[0].arguments["path"] == ctx / "Dockerfile" and calls[0].arguments["context_dir"] == str(ctx)


def test_e2b_says_a_build_context_needs_a_template() -> None:
    from miles_env.sandboxes.e2b import E2BSandboxConfig, E2BSandboxProvider

    p = E2BSandboxProvider(E2BSandboxConfig(api_key="k"), sdk=object())
    with pytest.raises(ConfigError, match="E2B runs templates, not Dockerfiles"):
        p.adapter.create_params(SandboxSpec(build="/tmp/ctx"), {})


def test_cli_lists_the_aliases_and_refuses_an_unobtainable_base_in_one_line() -> None:
    from typer.testing import CliRunner

    from miles_env.cli.main import app

    res = CliRunner().invoke(app, ["images", "aliases"])
    assert (
        res.exit_code == 0 and "ubuntu:(24\\.04|noble|latest)" in res.output and "debian:trixie" in res.output
    )
    res = CliRunner().invoke(app, ["images", "resolve", "harbor-agents-rich:latest"])
    assert res.exit_code == 2, res.output
    assert (
        res.output.count("\n") == 1
        and "error: base image 'harbor-agents-rich:latest' cannot be had" in res.output
    )
