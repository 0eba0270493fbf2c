"""The contract every replay-queue backend must meet (SQLite, Redis), as a reusable test class.

Use: subclass `QueueContract` in a test module and define a `backend` fixture returning a
`QueueBackend`: something that opens the queue under test on one storage (again and again, as
a restarted process would) and can corrupt a stored episode behind the queue's back:

    class TestSqliteContract(QueueContract):
        @pytest.fixture
        def backend(self, tmp_path): return SqliteBackend(tmp_path / "queue.db")

Behaviours: groups complete only at group_size; a retried put is a no-op (also after ack); state
and group size survive a reopen; leases (ack, release, expiry, renew, a void old lease, a batch
that fails as a whole); oldest completed first; staleness drops and counts; back-pressure (sync
and async); concurrent producers and a consumer; recover after a restart; a corrupted episode
quarantines its group (never returned, counted, logged once, durable).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import anyio
import pytest

from miles_env.queue.contract import QueueError, ReplayQueue
from miles_env.types import Episode, Reward, Status, Trajectory, Turn

__all__ = ["QueueBackend", "QueueContract", "fill", "make_episode"]


def make_episode(eid: str, group: str, *, version: int = 0, score: float = 1.0, n_tokens: int = 8) -> Episode:
    ids = list(range(100, 100 + n_tokens))
    mask = [0] * (n_tokens // 2) + [1] * (n_tokens - n_tokens // 2)
    lps = [0.0 if m == 0 else -0.1 * (i + 1) - 1e-9 * i for i, m in enumerate(mask)]
    traj = Trajectory(
        token_ids=ids,
        loss_mask=mask,
        logprobs=lps,
        turns=[
            Turn(
                start=n_tokens // 2,
                prompt_len=n_tokens // 2,
                completion_len=n_tokens // 2,
                finish_reason="stop",
                weight_version=version,
            )
        ],
    )
    return Episode(
        id=eid,
        task_id="t-" + group,
        env="toy",
        group_id=group,
        status=Status.COMPLETED,
        reward=Reward(score=score, details={"k": "v"}),
        samples=[traj, traj.model_copy(update={"branch": 1})],
        metadata={"x": [1, 2]},
    )


def fill(q: ReplayQueue, group: str, n: int, **kw: int | float) -> list[Episode]:
    eps = [make_episode(f"{group}-{i}", group, **kw) for i in range(n)]  # type: ignore[arg-type]
    for e in eps:
        assert q.put(e, block=False)
    return eps


class QueueBackend(Protocol):
    def open(self, *, group_size: int | None = None, max_pending_groups: int = 64) -> ReplayQueue:
        """The queue on this backend's storage; `group_size=None` reopens the existing one."""
        ...

    def corrupt(self, episode_id: str, offset: int) -> None:
        """Flip one bit of a stored episode's token arrays, as a bad disk or a stray write would."""
        ...


class QueueContract:
    def test_group_complete_only_at_group_size(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=3)
        fill(q, "g", 2)
        assert q.take(5) == []
        assert q.stats().open_groups == 1
        q.put(make_episode("g-2", "g"), block=False)
        (lease,) = q.take(5)
        assert lease.episode_ids == ["g-0", "g-1", "g-2"]  # in arrival order
        with pytest.raises(QueueError, match="already has group_size=3"):
            q.put(make_episode("g-3", "g"), block=False)

    def test_open_groups_lists_what_a_restart_must_complete(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=3)
        fill(q, "b:1", 2)
        fill(q, "a:2", 1)
        fill(q, "done", 3)  # complete: pending, not open
        assert [(g.group_id, g.task_id, g.n_have) for g in q.open_groups()] == [
            ("a:2", "t-a:2", 1),
            ("b:1", "t-b:1", 2),
        ]
        q.close()
        q = backend.open()  # durable: a restarted job reads them back
        assert [g.group_id for g in q.open_groups()] == ["a:2", "b:1"]
        q.put(make_episode("a:2-1", "a:2"), block=False)
        q.put(make_episode("a:2-2", "a:2"), block=False)  # completed under its own group id
        assert [g.group_id for g in q.open_groups()] == ["b:1"]
        assert q.stats().open_groups == 1 and q.stats().pending_groups == 2

    def test_duplicate_put_is_noop_even_after_ack(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=2)
        e = make_episode("a", "g")
        assert q.put(e, block=False)
        assert not q.put(e, block=False)
        assert q.stats().episodes["open"] == 1
        q.put(make_episode("b", "g"), block=False)
        q.ack(q.take(1))
        assert not q.put(e, block=False)  # a producer's retry after the group was trained
        s = q.stats()
        assert (s.acked_groups, s.episodes["acked"], s.open_groups) == (1, 2, 0)

    def test_new_queue_needs_group_size(self, backend: QueueBackend) -> None:
        with pytest.raises(QueueError, match="needs group_size"):
            backend.open()

    def test_durable_across_reopen(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=2)
        eps = fill(q, "g1", 2) + fill(q, "g2", 1)
        (lease,) = q.take(1, lease_s=60)
        q.close()
        q2 = backend.open()  # group_size read back from the storage
        assert q2.group_size == 2
        s = q2.stats()
        assert (s.leased_groups, s.open_groups, s.pending_groups) == (1, 1, 0)
        q2.release(lease)
        (again,) = q2.take(1)
        assert list(again.episodes) == eps[:2]  # bit for bit, logprobs included
        with pytest.raises(QueueError, match="group_size=3"):
            backend.open(group_size=3)

    def test_ack_release_and_expiry(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1)
        fill(q, "a", 1)
        fill(q, "b", 1)
        la, lb = q.take(2, lease_s=60)
        assert q.take(2) == []  # both leased
        q.ack(la)
        q.release(lb)
        (lb2,) = q.take(2, lease_s=0.05)
        assert lb2.group_id == "b" and lb2.lease_id != lb.lease_id
        with pytest.raises(QueueError, match="no longer held"):
            q.ack(lb)  # the old lease is void
        time.sleep(0.1)
        (lb3,) = q.take(2, lease_s=60)  # expired lease returned automatically
        assert lb3.group_id == "b"
        with pytest.raises(QueueError, match="no longer held"):
            q.release(lb2)  # expired and re-leased elsewhere: not ours to release
        q.ack(lb3)
        q.ack(lb3)  # acking twice is a no-op
        assert q.take(2) == []
        s = q.stats()
        assert s.acked_groups == 2 and s.leased_groups == 0 and s.complete_groups == 2

    def test_expired_lease_not_yet_reclaimed_can_still_ack_or_release(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1)
        fill(q, "a", 1)
        fill(q, "b", 1)
        la, lb = q.take(2, lease_s=0.05)
        time.sleep(0.1)
        assert q.take(0) == []  # expiry is applied: both back to pending, nobody took them
        q.ack(la)  # trained before expiry: acking keeps it from being trained twice
        q.release(lb)  # already pending: a no-op
        (again,) = q.take(5)
        assert again.group_id == "b"
        assert q.stats().acked_groups == 1

    def test_renew_keeps_a_lease_past_its_first_expiry(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1)
        fill(q, "a", 1)
        (lease,) = q.take(1, lease_s=0.3)
        q.renew(lease, 60)
        time.sleep(0.4)
        assert q.take(1) == []  # still held
        q.ack(lease)
        assert q.stats().acked_groups == 1

    def test_a_failing_batch_changes_nothing(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1)
        fill(q, "a", 1)
        fill(q, "b", 1)
        la, lb = q.take(2, lease_s=60)
        q.release(lb)
        (lb2,) = q.take(1, lease_s=60)
        with pytest.raises(QueueError, match="no longer held"):
            q.ack([la, lb])  # lb is void: la must not be acked either
        s = q.stats()
        assert (s.leased_groups, s.acked_groups) == (2, 0)
        q.ack([la, lb2])
        assert q.stats().acked_groups == 2

    def test_oldest_completed_first_and_released_groups_come_back_first(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1)
        for g in ("c", "a", "b"):
            fill(q, g, 1)
            time.sleep(0.002)
        assert [lease.group_id for lease in q.take(1)] == ["c"]
        (la,) = q.take(1)
        assert la.group_id == "a"
        q.release(la)
        fill(q, "d", 1)
        assert [lease.group_id for lease in q.take(5)] == ["a", "b", "d"]

    def test_staleness_filter_drops_and_counts(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=2)
        fill(q, "old", 2, version=1)
        q.put(make_episode("mix-0", "mix", version=5), block=False)
        q.put(make_episode("mix-1", "mix", version=2), block=False)  # one fresh, one stale episode
        fill(q, "new", 2, version=5)
        fill(q, "edge", 2, version=3)  # exactly current - max_staleness: kept
        leases = q.take(10, current_version=5, max_staleness=2)
        assert [lease.group_id for lease in leases] == ["mix", "new", "edge"]
        s = q.stats()
        assert s.stale_groups == 1 and s.stale_dropped_episodes == 2 and s.episodes["stale"] == 2
        mix = leases[0]  # per episode: only the stale one is left out, never trained
        assert [e.id for e in mix.episodes] == ["mix-0"] and [e.id for e in mix.stale] == ["mix-1"]
        assert mix.episode_ids == ["mix-0"] and all(not lease.stale for lease in leases[1:])
        q.release(leases)
        got = q.take(10, current_version=5, max_staleness=None)
        assert {lease.group_id for lease in got} == {"mix", "new", "edge"}  # stale groups never return
        assert all(len(lease.episodes) == 2 and not lease.stale for lease in got)  # no filter, no split

    def test_an_episode_with_no_sampled_turn_does_not_age_its_group(self, backend: QueueBackend) -> None:
        """An episode aborted before its first turn (a dead engine, a sandbox that never started) has
        no weight version: its group is as fresh as its sampled episodes, and a group of such
        episodes only is never stale (nothing in it was sampled)."""
        q = backend.open(group_size=2)
        aborted = make_episode("x", "x").model_copy(update={"samples": [], "status": Status.ABORTED})
        q.put(make_episode("mix-0", "mix", version=5), block=False)
        q.put(aborted.model_copy(update={"id": "mix-1", "group_id": "mix"}), block=False)
        q.put(aborted.model_copy(update={"id": "none-0", "group_id": "none"}), block=False)
        q.put(aborted.model_copy(update={"id": "none-1", "group_id": "none"}), block=False)
        fill(q, "old", 2, version=1)
        q.put(make_episode("gone-0", "gone", version=1), block=False)  # its only sampled one is stale
        q.put(aborted.model_copy(update={"id": "gone-1", "group_id": "gone"}), block=False)
        leases = q.take(10, current_version=5, max_staleness=1)
        assert sorted(lease.group_id for lease in leases) == ["mix", "none"]
        assert all(not lease.stale for lease in leases)
        assert q.stats().stale_groups == 2  # "old", and "gone": nothing of it can train

    def test_back_pressure_blocks_until_taken(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1, max_pending_groups=2)
        fill(q, "a", 1)
        fill(q, "b", 1)
        assert not q.has_capacity()
        with pytest.raises(TimeoutError):
            q.put(make_episode("c-0", "c"), timeout=0.1)
        done = threading.Event()

        def producer() -> None:
            q.put(make_episode("c-0", "c"))
            done.set()

        t = threading.Thread(target=producer)
        t.start()
        time.sleep(0.2)
        assert not done.is_set()
        q.take(1)
        assert done.wait(5)
        t.join()

    def test_async_put_waits_for_capacity(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=1, max_pending_groups=1).aio

        async def main() -> list[str]:
            order: list[str] = []
            await q.put(make_episode("a-0", "a"))

            async def produce() -> None:
                await q.put(make_episode("b-0", "b"))
                order.append("put")

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                await anyio.sleep(0.2)
                order.append("take")
                await q.take(1)
            return order

        assert anyio.run(main) == ["take", "put"]

    def test_concurrent_put_take_from_threads(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=4, max_pending_groups=8)
        n_groups, producers = 40, 4
        seen: list[str] = []

        def produce(k: int) -> None:
            for g in range(k, n_groups, producers):
                for i in range(4):
                    q.put(make_episode(f"g{g}-{i}", f"g{g}"))

        def consume() -> None:
            while len(seen) < n_groups * 4:
                for lease in q.take(3):
                    seen.extend(lease.episode_ids)
                    q.ack(lease)
                time.sleep(0.001)

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
        threads.append(threading.Thread(target=consume))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(seen) == len(set(seen)) == n_groups * 4
        assert q.stats().acked_groups == n_groups

    def test_recover_acks_trained_and_releases_rest(self, backend: QueueBackend) -> None:
        q = backend.open(group_size=2)
        fill(q, "a", 2)
        fill(q, "b", 2)
        fill(q, "c", 2)
        la, lb = q.take(2, lease_s=0.01)
        time.sleep(0.05)  # a's lease expires: a trained group must still be acked, not re-trained
        q.close()
        q = backend.open()
        acked, released = q.recover([*la.episode_ids, "never-stored"])
        assert acked == 1
        got = {lease.group_id for lease in q.take(10)}
        assert got == {"b", "c"}
        assert q.recover(la.episode_ids) == (0, 2)  # idempotent; frees the leases just taken

    def test_corrupted_episode_is_quarantined_never_returned(
        self, backend: QueueBackend, caplog: pytest.LogCaptureFixture
    ) -> None:
        q = backend.open(group_size=2)
        fill(q, "bad", 2)
        good = fill(q, "good", 2)
        backend.corrupt("bad-1", offset=-3)  # inside the last logprob: decodes fine, silently changed
        with caplog.at_level(logging.ERROR):
            leases = q.take(10)
            assert q.take(10) == []
        assert [lease.group_id for lease in leases] == ["good"]
        assert list(leases[0].episodes) == good
        s = q.stats()
        assert (s.quarantined_groups, s.quarantined_episodes, s.pending_groups) == (1, 1, 0)
        assert s.episodes["quarantined"] == 2
        logged = [r for r in caplog.records if "bad-1" in r.getMessage()]
        assert len(logged) == 1 and "checksum" in logged[0].getMessage()
        q.close()
        reopened = backend.open()  # the quarantine is durable
        assert reopened.take(10) == [] and reopened.stats().quarantined_episodes == 1
