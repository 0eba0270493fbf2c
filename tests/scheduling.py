"""How the suite is spread over pytest-xdist workers (scripts/test.sh runs `-n N --dist loadgroup`).

Concept: a test module is one unit of work (its module-scoped fixtures, a model load or a server,
are built once, on one worker), except where several modules share a machine-wide resource that
one test may look at as a whole: those modules form one group, run in order on one worker. The
groups, and why:
- `host-procs`: tests that scan /proc for processes they must have killed (sandbox close, a
  SIGKILLed run, a worker pool), or reap what a dead run left (`sandbox gc`, tmpfs mounts, zygote
  cgroups): a sibling test's live sandbox or worker would look like a leak, or be reaped.
- `docker`: the one dockerd; reaper tests remove containers by label.
- `ray`: one local Ray cluster at a time (each takes ~1.5 GB and both cores to start).
- `vllm`: one vLLM CPU server at a time (it binds its OMP threads to both cores).
Heavy units go first (HEAVY_FIRST), so no long module starts last while the other worker idles.
Without xdist (`pytest` alone) none of this changes anything: the order is only a reordering of
whole modules, and the markers are ignored.
"""

from __future__ import annotations

import pytest

__all__ = ["group_of", "schedule"]

_GROUPS: dict[str, tuple[str, ...]] = {
    "host-procs": (
        "test_sandbox_local", "test_sandbox_pool", "test_sandbox_sigint", "test_harness_faults",
        "test_adapters_contract", "test_adapters_isolation", "test_adapters_worker",
        "test_task_limits", "test_guards",
    ),
    "docker": ("test_sandbox_docker",),
    "ray": ("test_cluster", "test_cluster_engine_faults", "test_cluster_engines", "test_cluster_faults",
            "test_cluster_job", "test_cluster_trainer"),
    "vllm": ("test_engine_vllm", "test_opd_vllm"),
}  # fmt: skip
_BY_MODULE = {m: g for g, modules in _GROUPS.items() for m in modules}

# Units that take minutes: started first (measured in tests/README.md's budget).
HEAVY_FIRST = ("ray", "vllm", "host-procs", "docker", "test_adapters_harbor_agents", "test_harness_codex")


def group_of(item: pytest.Item) -> str:
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else item.nodeid
    return _BY_MODULE.get(module, module)


def schedule(items: list[pytest.Item]) -> None:
    """Mark each test with its xdist group and move the heavy units to the front (stable)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))
    items.sort(key=lambda it: rank.get(group_of(it), len(rank)))
