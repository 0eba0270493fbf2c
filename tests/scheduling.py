"""How the suite is spread over pytest-xdist workers (scripts/test.sh runs `pytest -n N`).

Concept: a test module is one unit of work (its module-scoped fixtures, a model load or a server,
are built once, on one worker), except where several modules share a machine-wide resource that
one test may look at as a whole: those modules form one group, run in order on one worker. The
groups, and why:
- `host-procs`: tests that scan /proc for processes they must have killed (sandbox close, a
  SIGKILLed run, a worker pool), or reap what a dead run left (`sandbox gc`, tmpfs mounts, zygote
  cgroups): a sibling test's live sandbox or worker would look like a leak, or be reaped.
- `docker`: the one dockerd; reaper tests remove containers by label.
- `ray`: one local Ray cluster at a time (each takes ~1.5 GB and both cores to start).
- `vllm`: one vLLM CPU server at a time (it binds its OMP threads to both cores; its worker holds
  ~3.7 GB).
- `megatron`: the dp and pp comparisons share one single-process reference run (conftest
  `megatron_single`), built once on the worker that runs them.
Heavy units go first (HEAVY_FIRST), so no long module starts last while the other worker idles.
Without xdist (`pytest` alone) nothing changes but the order, a reordering of whole modules.

Why a scheduler of our own (`GroupScheduling`, xdist's `pytest_xdist_make_scheduler` hook) and not
`--dist loadgroup` with `xdist_group` markers: pytest 9 reads `Node.nodeid` from a structured id,
so xdist 3.8's loadgroup (which renames `item._nodeid` to `...@group`) groups nothing; seen here:
two modules marked with one group ran on two workers at once (tests/test_test_hygiene.py checks
that ours holds).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

__all__ = ["group_of", "schedule", "scope_of", "make_scheduler"]

_GROUPS: dict[str, tuple[str, ...]] = {
    "host-procs": (
        "test_sandbox_local", "test_sandbox_pool", "test_sandbox_sigint", "test_harness_faults",
        "test_adapters_contract", "test_adapters_isolation", "test_adapters_worker",
        "test_task_limits", "test_guards", "test_sandbox_network",
    ),
    "docker": ("test_sandbox_docker",),
    "ray": ("test_cluster", "test_cluster_engine_faults", "test_cluster_engines", "test_cluster_faults",
            "test_cluster_job", "test_cluster_trainer"),
    "vllm": ("test_engine_vllm", "test_opd_vllm"),
    "megatron": ("test_megatron_dp", "test_megatron_pp"),
}  # fmt: skip
_BY_MODULE = {m: g for g, modules in _GROUPS.items() for m in modules}

# Units that take minutes: started first (measured in tests/README.md's budget).
HEAVY_FIRST = (
    "ray", "vllm", "host-procs", "docker", "megatron", "test_adapters_harbor_agents", "test_harness_docs", "test_harness_codex",
)  # fmt: skip


def scope_of(nodeid: str) -> str:
    """The unit of work of a test id: its module's group, else the module itself."""
    stem = PurePosixPath(nodeid.split("::", 1)[0]).stem
    return _BY_MODULE.get(stem, stem)


def group_of(item: pytest.Item) -> str:
    return scope_of(item.nodeid)


def schedule(items: list[pytest.Item]) -> None:
    """Move the heavy units to the front, keeping every other order (a stable sort)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(group_of(it), len(rank)))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's LoadScopeScheduling with our units: each unit runs whole, in order, on one worker."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep schedule()'s order (xdist's default: most tests first)

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return GroupScheduling(config, log)
