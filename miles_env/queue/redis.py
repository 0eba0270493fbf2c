"""The replay queue on Redis: the contract of contract.py, shared by rollout and trainer hosts.

Concept: the same queue as `SqliteReplayQueue` (GRPO groups complete at `group_size`, leases,
acks after the checkpoint, staleness filter, back-pressure, per-episode sha256 checks with
quarantine), for runs whose producers and trainer do not share a disk. SQLite stays the
embedded default; tests/queue_contract.py runs one suite against both.

Invariant: every state change is one Lua script (redis_scripts.py), which Redis runs
alone and its append-only file (AOF) logs whole, so a crash of Redis or of a client keeps each
change whole or absent, as sqlite.py's transactions do. The queue refuses a server without AOF
(`require_aof`): a restart would lose everything. Run it with `appendfsync always`: Redis then
writes and fsyncs before it replies, so a put or ack that returned survives a crash of Redis and a
power cut alike. With `everysec` (warned about at open) a reply means only "in the kernel, soon":
Redis even postpones the write itself for up to 2 s while an fsync stalls, so a crash then, or a
power cut, loses the last seconds. tests/test_queue_redis.py kill -9s redis-server mid-run under
both; bench/bench_queue.py --backends measures what `always` costs.

Why hashes, sorted sets and scripts rather than Streams: a stream's consumer group tracks
deliveries, but a lease here is the state of a GRPO group with its own duration, renewed across
steps; release must return a group ahead of newer ones; the staleness filter drops pending
groups whose newest sampled version is too old (a lease holds a group's stale episodes apart);
and each change must move the counters that `stats` and back-pressure read. A script over hashes and sorted sets does each in one atomic step.

Integrity: `put` stores the sha256 of each episode's bytes (codec.py); `take` leases
groups in one script, checks them here, and moves a group with a bad episode to quarantined in a
second script. A client that dies between the two only leaves a lease that expires, and the
next `take` checks that group again. Payloads of acked and stale groups are deleted (Redis holds
its data in memory); their ids stay, so a retried `put` is still a no-op and `recover` still
finds them.

Failures: a Redis that cannot be reached is retried for `retry_s` seconds (a restart), then
surfaces as QueueError, as does any other Redis error. A `take` whose reply is lost leaves its
groups leased until the lease expires (or `recover` at the trainer's restart): late, never lost.

Lifecycle: `RedisReplayQueue(url, prefix=..., group_size=...)`, then the methods of
`SqliteReplayQueue` (its `.aio` is the same anyio face), then `close()`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from miles_env.jsonio import dumps
from miles_env.queue import redis_scripts as lua
from miles_env.queue.aio import AsyncReplayQueue
from miles_env.queue.codec import decode_episode, encode_episode, payload_checksum
from miles_env.queue.contract import (
    UNSAMPLED_VERSION,
    GroupState,
    Lease,
    OpenGroup,
    QueueError,
    QueueStats,
    group_version,
    split_stale,
    wait_for_capacity,
)
from miles_env.types import Episode

if TYPE_CHECKING:
    import redis

__all__ = ["RedisReplayQueue"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TAKE_BATCH = 64  # groups leased per script call (a script blocks the server while it runs)

_STATES = [
    GroupState.OPEN,
    GroupState.PENDING,
    GroupState.LEASED,
    GroupState.ACKED,
    GroupState.STALE,
    GroupState.QUARANTINED,
]

# (episode id, meta, arrays, checksum) as TAKE returns them; a missing field is None.
_Stored = tuple[bytes, bytes | None, bytes | None, bytes | None]


class RedisReplayQueue:
    """The replay queue in a Redis server, every key under `prefix`. `group_size=None` opens an
    existing queue with its stored group size."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        group_size: int | None = None,
        max_pending_groups: int = 64,
        require_aof: bool = True,
        retry_s: float = 30.0,
    ) -> None:
        import redis

        if max_pending_groups < 1:
            raise QueueError(f"max_pending_groups={max_pending_groups}: must be >= 1")
        if not prefix or "{" in prefix or "}" in prefix:
            raise QueueError(f"prefix={prefix!r}: must be non-empty, without braces")
        self.url = url
        self.prefix = prefix
        self.max_pending_groups = max_pending_groups
        self.retry_s = retry_s
        self._p = "{" + prefix + "}"  # one hash tag: every key of this queue in one cluster slot
        self._redis: redis.Redis = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=120)
        self._scripts = {
            name: self._redis.register_script(getattr(lua, name))
            for name in ("INIT", "PUT", "TAKE", "QUARANTINE", "FINISH", "RENEW", "RECOVER")
        }
        if require_aof:
            self._check_aof()
        self.group_size = self._init_group_size(group_size)

    def __repr__(self) -> str:
        return f"RedisReplayQueue({self.where})"

    @property
    def where(self) -> str:
        """How messages name this queue: the server (without credentials) and the prefix."""
        kw = self._redis.connection_pool.connection_kwargs
        return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)} prefix {self.prefix!r}"

    # -- plumbing --------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one Redis round trip; ride out an unreachable server for `retry_s` (a restart, an
        AOF still loading), then, like every other Redis failure, raise QueueError."""
        import redis

        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise QueueError(f"replay queue {self.where}: {e}") from e
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
            except redis.RedisError as e:
                raise QueueError(f"replay queue {self.where}: {e}") from e

    def _script(self, name: str, *args: Any) -> Any:
        script = self._scripts[name]
        return self._call(lambda: script(keys=[self._p + ":meta"], args=[self._p, *args]))

    def _check_aof(self) -> None:
        import redis

        info = self._call(lambda: self._redis.info("persistence"))
        if int(info.get("aof_enabled", 0)) != 1:
            raise QueueError(
                f"replay queue {self.where}: the server runs without its append-only file, so a restart "
                "would lose the queue; start it with --appendonly yes (or set require_aof: false)"
            )
        try:  # managed services may refuse CONFIG: then the operator's word is all there is
            fsync = self._redis.config_get("appendfsync").get("appendfsync")
        except redis.ResponseError:
            return
        if fsync not in (None, "always", b"always"):
            log.warning(
                "replay queue %s: appendfsync %s: Redis answers before its AOF reaches the disk, so a power "
                "cut (or a crash while the disk stalls) can lose the last seconds of puts; `always` is the "
                "setting under which a reply means stored",
                self.where,
                fsync.decode() if isinstance(fsync, bytes) else fsync,
            )

    def _init_group_size(self, group_size: int | None) -> int:
        if group_size is not None and group_size < 1:
            raise QueueError(f"group_size={group_size}: must be >= 1")
        stored = int(self._script("INIT", "" if group_size is None else group_size))
        if stored < 0:
            raise QueueError(f"{self.where}: new replay queue needs group_size")
        if group_size is not None and group_size != stored:
            raise QueueError(f"group_size={group_size} but {self.where} was created with group_size={stored}")
        return stored

    def close(self) -> None:
        self._redis.close()

    # -- producer side ---------------------------------------------------------------------------

    def put(self, episode: Episode, *, block: bool = True, timeout: float | None = None) -> bool:
        """Store one episode; False if its id was already stored. With `block`, first wait for
        capacity (back-pressure); TimeoutError after `timeout` seconds."""
        if block and not self.wait_for_capacity(timeout):
            raise TimeoutError(f"replay queue {self.where} full for {timeout}s")
        meta, blob = encode_episode(episode)
        done = self._script(
            "PUT",
            episode.id,
            episode.group_id,
            group_version(episode),
            self.group_size,
            meta,
            blob,
            payload_checksum(meta, blob),
            episode.min_weight_version if episode.sampled else "",
            UNSAMPLED_VERSION,
        )
        if done < 0:
            raise QueueError(
                f"episode {episode.id!r}: group {episode.group_id!r} already has group_size="
                f"{self.group_size} episodes"
            )
        return bool(done)

    def has_capacity(self) -> bool:
        pending = self._call(lambda: self._redis.zcard(self._p + ":pending"))
        return int(pending) < self.max_pending_groups

    def wait_for_capacity(self, timeout: float | None = None) -> bool:
        """Block while max_pending_groups complete groups are waiting; False on timeout."""
        return wait_for_capacity(self, timeout)

    # -- consumer side ---------------------------------------------------------------------------

    def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]:
        """Lease up to `n_groups` pending groups, oldest completed first (may return fewer), each with
        its stale episodes apart (contract.py). A group holding an episode whose bytes fail their
        checksum is quarantined instead of returned."""
        oldest_ok = None if max_staleness is None else current_version - max_staleness
        leases: list[Lease] = []
        while True:  # once even for n_groups=0: expiry and the staleness filter still apply
            want = min(n_groups - len(leases), _TAKE_BATCH)
            arg = "" if oldest_ok is None else oldest_ok
            got = self._script("TAKE", want, arg, repr(float(lease_s)), *self._lease_ids(want))
            for gid, lid, exp, stored in got:
                lease = self._lease(gid.decode(), lid.decode(), float(exp), stored, oldest_ok)
                if lease is not None:
                    leases.append(lease)
            if len(got) < want or len(leases) >= n_groups:  # a quarantined group leaves room: go on
                return leases

    @staticmethod
    def _lease_ids(n: int) -> list[str]:
        return [uuid.uuid4().hex for _ in range(n)]

    def _lease(
        self, group_id: str, lease_id: str, expires_at: float, stored: list[_Stored], oldest_ok: int | None
    ) -> Lease | None:
        """The lease (stale episodes apart), once every episode passed its checksum; else None, the
        group quarantined."""
        episodes: list[Episode] = []
        bad: list[tuple[str, str]] = []
        for eid, meta, blob, want in stored:  # checked as raw bytes: corrupted meta cannot fail first
            if meta is None or blob is None:
                bad.append((eid.decode(), "payload missing"))
            elif want is None:
                bad.append((eid.decode(), "checksum missing"))
            elif payload_checksum(meta, blob) != want.decode():
                bad.append((eid.decode(), "checksum mismatch: stored bytes changed since put"))
            elif not bad:
                episodes.append(decode_episode(meta.decode(), blob))
        if not bad:
            fresh, stale = split_stale(episodes, oldest_ok)
            return Lease(lease_id, group_id, fresh, expires_at, stale)
        now = time.time()
        records = [(bad_id, dumps({"group_id": group_id, "reason": why, "at": now})) for bad_id, why in bad]
        if self._script("QUARANTINE", group_id, lease_id, *[x for pair in records for x in pair]):
            for bad_id, why in bad:  # logged once: only the take that quarantined it gets here
                log.error(
                    "replay queue %s: episode %r quarantined with its group %r (%s); it will not be trained",
                    self.where,
                    bad_id,
                    group_id,
                    why,
                )
        return None

    def ack(self, leases: Lease | Sequence[Lease]) -> None:
        """Mark leased groups done; they are never returned again. An expired lease whose group was
        re-leased elsewhere raises QueueError (that group would otherwise be trained twice)."""
        self._finish(leases, GroupState.ACKED)

    def release(self, leases: Lease | Sequence[Lease]) -> None:
        """Return leased groups to pending (for example when a step is abandoned)."""
        self._finish(leases, GroupState.PENDING)

    def renew(self, leases: Lease | Sequence[Lease], lease_s: float) -> None:
        """Extend leases held across several steps (acks wait for the next checkpoint)."""
        self._script("RENEW", repr(float(lease_s)), *_pairs(leases))

    def _finish(self, leases: Lease | Sequence[Lease], state: str) -> None:
        pairs = _pairs(leases)
        if not pairs:
            return
        verdict, *rest = (x.decode() for x in self._script("FINISH", str(state), *pairs))
        if verdict == "unknown":
            raise QueueError(f"lease {rest[1]}: unknown group {rest[0]!r}")
        if verdict == "lost":
            raise QueueError(f"lease {rest[1]} on group {rest[0]!r} is no longer held (state {rest[2]})")

    def recover(self, trained_episode_ids: Iterable[str]) -> tuple[int, int]:
        """After a trainer restart: ack every not-yet-acked group whose episodes the restored
        checkpoint already trained on, release every other lease. Returns (acked, released) groups."""
        acked, released = self._script("RECOVER", *sorted(set(trained_episode_ids)))
        return int(acked), int(released)

    # -- introspection ---------------------------------------------------------------------------

    def open_groups(self) -> list[OpenGroup]:
        """Every open group, by group id, with its task (read from its first episode). A SCAN of
        the group keys: meant for a restart, not for every step."""

        def scan() -> list[OpenGroup]:
            found = []
            for key in self._redis.scan_iter(match=f"{self._p}:g:*", count=1000):
                state, n = self._redis.hmget(key, "state", "n")
                if state != b"open" or not isinstance(n, bytes):
                    continue
                gid = (key.decode() if isinstance(key, bytes) else key)[len(self._p) + 3 :]
                first = self._redis.lindex(f"{self._p}:ge:{gid}", 0)
                eid = first.decode() if isinstance(first, bytes) else first
                meta = self._redis.hget(f"{self._p}:e:{eid}", "meta") if eid else None
                task = json.loads(meta)["task_id"] if meta else ""
                found.append(OpenGroup(gid, str(task), int(n)))
            return sorted(found, key=lambda g: g.group_id)

        return self._call(scan)

    def stats(self) -> QueueStats:
        def snapshot() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)  # MULTI/EXEC: one consistent view
            pipe.hgetall(self._p + ":count")
            pipe.hget(self._p + ":meta", "stale_dropped")
            pipe.hlen(self._p + ":quarantine")
            return list(pipe.execute())

        counts, dropped, bad_episodes = self._call(snapshot)
        raw = {k.decode(): int(v) for k, v in counts.items()}
        groups = {str(s): raw.get(f"g:{s}", 0) for s in _STATES}
        return QueueStats(
            group_size=self.group_size,
            max_pending_groups=self.max_pending_groups,
            open_groups=groups[GroupState.OPEN],
            pending_groups=groups[GroupState.PENDING],
            leased_groups=groups[GroupState.LEASED],
            acked_groups=groups[GroupState.ACKED],
            stale_groups=groups[GroupState.STALE],
            quarantined_groups=groups[GroupState.QUARANTINED],
            complete_groups=sum(v for k, v in groups.items() if k != GroupState.OPEN),
            episodes={str(s): raw.get(f"e:{s}", 0) for s in _STATES},
            stale_dropped_episodes=int(dropped or 0),
            quarantined_episodes=int(bad_episodes),
        )

    @property
    def aio(self) -> AsyncReplayQueue:
        return AsyncReplayQueue(self)


def _pairs(leases: Lease | Sequence[Lease]) -> list[str]:
    items = [leases] if isinstance(leases, Lease) else list(leases)
    return [x for lease in items for x in (lease.group_id, lease.lease_id)]
