"""Benchmark of task images: buildah (local provider) against dockerd's build of the same Dockerfile.

Run: python bench/bench_images.py [--rounds 3] [--bootstrap] [--cache DIR]
In the same run, interleaved round by round, for one Terminal-Bench-shaped Dockerfile
(`FROM debian:bookworm` through the loopback registry, apt-get install, useradd + USER, writes
under /opt and /var/log, a here-document):
  cold   : a build no cache has seen (a per-round nonce in the first RUN, so neither buildah nor
           dockerd's layer cache can reuse a step); local = buildah build + unpack as a root
           filesystem; docker = dockerd's build (the baseline: ratios are local / docker)
  cached : the same context again from a new builder, as a new process would: the key lookup
           (resolution of the base by digest included), no build
  first  : the first time a base is used by a builder: pull from the loopback registry (and for
           an alias, the substitute's build), reported once
`--bootstrap` also times `miles-env images bootstrap --refresh` (both suites at once), which
once per machine (once per CI run) precedes all of this. `--cache` picks the images cache
(default $MILES_ENV_CACHE/images); a private one keeps the shared cache untouched.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import docker

from miles_env.sandboxes.docker.build import DockerBuilder
from miles_env.sandboxes.images.bootstrap import bootstrap
from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.local import LocalImages

DOCKERFILE = """\
FROM debian:bookworm
RUN echo {nonce} > /opt/nonce
RUN apt-get update && apt-get install -y --no-install-recommends tree && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1234 agent && mkdir -p /var/log/app && chown agent /var/log/app
ENV APP_MODE=bench
WORKDIR /opt
USER agent
RUN echo "built-as-$(id -un)" > /var/log/app/built.txt
RUN <<EOF
echo from a here-document > /var/log/app/heredoc.txt
EOF
"""


def _context(root: Path, nonce: str) -> Path:
    ctx = root / nonce
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(nonce=nonce))
    return ctx


def _timed(fn: Callable[[Path], object], ctx: Path) -> float:
    start = time.perf_counter()
    fn(ctx)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bootstrap", action="store_true")
    ap.add_argument("--cache", default=None)
    args = ap.parse_args()
    config = ImagesConfig(direct=False, cache_dir=args.cache)
    if args.bootstrap:
        start = time.perf_counter()
        results = bootstrap(config, refresh=True)
        print(
            f"bootstrap (bookworm + trixie at once): {time.perf_counter() - start:.1f} s  "
            + ", ".join(f"{r.suite} {r.seconds:.1f} s" for r in results)
        )
    else:
        bootstrap(config)
    client = docker.from_env(timeout=1800)
    series: dict[str, list[float]] = {
        k: [] for k in ("local cold", "docker cold", "local cached", "docker cached")
    }
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        root = Path(tmp)
        warm = _context(root, "warmup-" + os.urandom(4).hex())
        print(
            f"first use of the base, local (pull + build + unpack): {_timed(LocalImages(config).build, warm):.1f} s"
        )
        print(
            f"first use of the base, docker (pull + build): {_timed(DockerBuilder(client, config).build, warm):.1f} s"
        )
        for _ in range(args.rounds):
            ctx = _context(root, os.urandom(6).hex())
            series["local cold"].append(_timed(LocalImages(config).build, ctx))
            series["docker cold"].append(_timed(DockerBuilder(client, config).build, ctx))
            series["local cached"].append(_timed(LocalImages(config).build, ctx))
            series["docker cached"].append(_timed(DockerBuilder(client, config).build, ctx))
        for tag in {DockerBuilder(client, config).build(c)[0] for c in root.iterdir()}:
            client.images.remove(tag, force=True)  # the engine keeps none of the bench's builds
    med = {k: statistics.median(v) for k, v in series.items()}
    print(f"\n| series | median s ({args.rounds} rounds) | ratio local/docker |")
    print("|---|---|---|")
    for kind in ("cold", "cached"):
        local, dock = med[f"local {kind}"], med[f"docker {kind}"]
        print(f"| docker {kind} (baseline) | {dock:.3f} | 1.00x |")
        print(f"| local {kind} | {local:.3f} | {local / dock:.2f}x |")


if __name__ == "__main__":
    main()
