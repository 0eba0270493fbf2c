"""Shared test configuration: offline, quiet, the `slow` marker, and no silent skips in CI; the
`tiny_model` fixture the end-to-end training runs share (a tiny random Llama with the SmolLM2 tokenizer),
the session's `tiny_moe` (a tiny random Qwen3-MoE, same tokenizer)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# -- spreading the suite over xdist workers (tests/scheduling.py says how and why) ------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.scheduling import schedule

    schedule(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)


# -- shared fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 32) with the real SmolLM2 tokenizer, so `miles-env train`
    runs its real engine, proxy and trainer in seconds (tests/train_support.py drives it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles_env.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    path = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """trainer_support's tiny model (its own 96-token vocabulary): the trainer-loop tests'."""
    from tests.trainer_support import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def trajs(tiny: Path) -> tuple[Any, Any]:
    """Two sampled trajectories of `tiny` (trainer_support.rollouts) that the episodes reuse."""
    from tests.trainer_support import rollouts

    return rollouts(tiny)


@pytest.fixture(scope="session")
def megatron_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, float]]]:
    """The single-process megatron run every dp/pp comparison is measured against (model, out dir,
    metrics): `megatron_support.tiny_model` (seeded, so the same weights each time) trained one
    process, pp 1, kl 0.1. Built once per session (the `megatron` unit, tests/scheduling.py)."""
    from tests import megatron_support

    root = tmp_path_factory.mktemp("megatron_single")
    model = megatron_support.tiny_model(root / "m")
    return model, root / "one", megatron_support.run_torchrun(root / "one", 1, str(model), "1", "0.1")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE checkpoint (2 layers, 4 experts, top 2; ~6 MB) with the SmolLM2
    tokenizer, built once per test session by `miles_env.models.make_tiny_moe` (tests/test_moe*.py)."""
    from miles_env.models import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("tiny_moe") / "model")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A real local multi-node Ray cluster: a head without CPUs and two worker nodes, each offering
    {"rollout": 1} (the cluster tests, tests/test_cluster*.py). One per module (a start is ~15 s of
    both cores): each run is its own Ray job, whose actors Ray reaps when its driver exits or dies;
    a test that removes a node comes last in its module."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * (1 << 20)},
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=100 * (1 << 20))
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def engine_cluster() -> Iterator[Any]:
    """A real local Ray cluster whose two nodes offer {"rollout": 1} and {"engine": 1} each (the
    placed-engine tests; tests/cluster_support.py `engine_nodes`)."""
    from tests.cluster_support import engine_nodes

    with engine_nodes() as cluster:
        yield cluster


# -- what the session leaves on the host (tests/host_leftovers.py) ------------------------------
_IMAGES_BEFORE = pytest.StashKey["frozenset[str] | None"]()


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # an xdist worker has it; the controller does not


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers (trylast), so they inherit the owner
def pytest_sessionstart(session: pytest.Session) -> None:
    # Only the outermost session: a pytester run inside it (test_no_silent_skips) inherits this
    # variable and must not remove the images a sibling worker builds meanwhile.
    if _controller(session.config) and not os.environ.get("MILES_ENV_TEST_IMAGES_OWNER"):
        from tests.host_leftovers import NAMESPACE, snapshot

        os.environ["MILES_ENV_TEST_IMAGES_OWNER"] = str(os.getpid())
        # What the session builds in a docker engine is named apart from a user's runs' images
        os.environ.setdefault("MILES_ENV_IMAGE_NAMESPACE", NAMESPACE)
        session.config.stash[_IMAGES_BEFORE] = snapshot()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _controller(session.config) and _IMAGES_BEFORE in session.config.stash:
        from tests.host_leftovers import remove_new

        n = remove_new(session.config.stash[_IMAGES_BEFORE], os.environ["MILES_ENV_IMAGE_NAMESPACE"])
        if n:
            print(f"\n[tests] removed {n} docker images this session built")


# -- task images: one bootstrap, one build per image per session (tests/images_support.py) ----------
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the image tests' bootstrap and builds in the background once they are selected."""
    if os.environ.get("MILES_ENV_IMAGES_PREWARM", "1") == "0":
        return
    if any(item.nodeid.startswith("tests/test_images.py") for item in session.items):
        from tests.images_support import prewarm

        prewarm()


@pytest.fixture(scope="session")
def image_bases() -> Any:
    """debian:bookworm and debian:trixie in the loopback registry (made once; then a lookup)."""
    from tests.images_support import prewarmed

    return prewarmed("bases")


@pytest.fixture(scope="session")
def image_contexts() -> dict[str, Path]:
    """The test images' build contexts (fixed contents, so their cache keys are stable)."""
    from tests.images_support import contexts

    return contexts()


@pytest.fixture(scope="session")
def local_images(image_bases: Any) -> Any:
    """The local provider's builder (buildah), over the session's bootstrapped bases."""
    from tests.images_support import prewarmed

    return prewarmed("images")


@pytest.fixture(scope="session")
def bookworm_image(local_images: Any) -> Any:
    from tests.images_support import prewarmed

    return prewarmed("bookworm")


@pytest.fixture(scope="session")
def alias_image(local_images: Any) -> Any:
    from tests.images_support import prewarmed

    return prewarmed("aliases")
