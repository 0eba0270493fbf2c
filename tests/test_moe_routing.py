"""A MoE rollout's routing through TITO, model-free: the packed record (types.RoutedExperts), the
samples a session exports (each carries the rows of exactly its mask-1 tokens, across forks and
undelivered turns), the journal replay and `tito audit`. The real engine and trainer's side is
tests/test_moe_engine.py's chat through the proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from miles_env.tito import Budget
from miles_env.tito.audit import audit
from miles_env.tito.journal import TurnEvent, TurnRecord, UndeliveredEvent
from miles_env.tito.session import Session
from miles_env.tito.store import Journal, load_sessions
from miles_env.types import RoutedExperts, Trajectory

SID = "s1"


def _rows(n: int, base: int) -> list[list[list[int]]]:
    return [[[(base + t) % 4, 4 + (base + t) % 3], [t % 2, 2 + t % 2]] for t in range(n)]  # 2 layers, top 2


def _turn(branch: int, prompt: list[int], out: list[int], keys: list[str], routed: bool = True, **kw: Any) -> TurnEvent:  # fmt: skip
    rec = RoutedExperts.pack(_rows(len(out), out[0])) if routed else None
    return TurnEvent(branch=branch, new_branch=kw.pop("new_branch", False), tools_key="t", prompt_ids=prompt,
                     output_ids=out, logprobs=[-0.5] * len(out), keys=keys,
                     turn=TurnRecord(finish_reason="stop"), routed_experts=rec, **kw)  # fmt: skip


A = _turn(0, [1, 2], [3, 4, 5], ["u1", "a1"], new_branch=True)
B = _turn(0, [6], [7, 8], ["u2", "a2"])
C = _turn(1, [9], [10, 11], ["u3", "a3"], new_branch=True, parent=0, fork_keys=2, fork_tokens=5)
D = _turn(1, [12], [13], ["u4", "a4"], routed=False)  # a turn the engine gave no routing for


def test_a_record_packs_compactly_and_a_sample_refuses_one_of_another_length() -> None:
    rows = _rows(5, 0)
    rec = RoutedExperts.pack(rows)
    assert rec.rows() == rows and (rec.tokens, rec.itemsize, len(rec.raw())) == (5, 1, 5 * 2 * 2)
    wide = RoutedExperts.pack([[[1, 300]]])  # more than 256 experts: uint16
    assert wide.itemsize == 2 and RoutedExperts.concat([rec, rec]).rows() == rows + rows
    assert RoutedExperts.concat([RoutedExperts.pack([[[1, 2]]]), wide]).rows() == [[[1, 2]], [[1, 300]]]
    t = Trajectory(token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0] + [1] * 5, logprobs=[0.0] + [-1.0] * 5,
                   routed_experts=rec)  # fmt: skip
    assert Trajectory.model_validate_json(t.model_dump_json()) == t  # JSON (episodes, exports) as is
    with pytest.raises(ValidationError, match="routed_experts has 5 tokens: must be 4, one per token") as e:
        Trajectory(token_ids=[1, 2, 3, 4, 5], loss_mask=[0] + [1] * 4, logprobs=[0.0] + [-1.0] * 4,
                   routed_experts=rec)  # fmt: skip
    assert "\n" not in str(e.value.errors()[0]["msg"])
    with pytest.raises(ValidationError, match="3 bytes is no whole number of 4-byte rows"):
        RoutedExperts.from_raw(b"abc", layers=2, top_k=2)
    with pytest.raises(ValidationError, match="routed_experts.data: not base64"):
        RoutedExperts(layers=1, top_k=1, data="*")


def _session(events: list[Any]) -> Session:
    s = Session(SID, "k", {}, Budget(), 0.0)
    for e in events:
        s.apply(e)
    return s


def _routing(t: Trajectory) -> list[list[list[int]]] | None:
    return t.routed_experts.rows() if t.routed_experts is not None else None


def test_each_exported_sample_carries_the_routing_of_exactly_its_trained_tokens(tmp_path: Path) -> None:
    a, b, c = (_rows(len(e.output_ids), e.output_ids[0]) for e in (A, B, C))
    b0, b1 = _session([A, B, C]).trajectories("all")
    assert (_routing(b0), _routing(b1)) == (a + b, c)  # the fork's copy of A trains in branch 0 only
    (last,) = _session([A, B, C]).trajectories("last")
    assert _routing(last) == a + c  # exported alone, the fork owns the copy of A too
    undelivered = UndeliveredEvent(branch=0, start=6, reason="retried")
    assert _routing(_session([A, B, undelivered]).trajectories()[0]) == a  # B never trains
    assert _routing(_session([A, B, C, D]).trajectories()[1]) is None  # D has none: the sample has none
    # the journal keeps it: a restarted proxy exports the same samples, and the audit is clean
    journal = Journal(tmp_path)
    s = _session([A, B, C])
    journal.append(SID, s.header())
    for e in (A, B, C):
        journal.append(SID, e)
    journal.write_export(SID, "all", s.trajectories())
    assert load_sessions(tmp_path)[SID].trajectories() == s.trajectories()
    report = audit(tmp_path)
    assert report.ok and report.snapshots == 1, report.drifts
