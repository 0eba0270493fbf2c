"""Replay queue throughput: put + take + ack of 4k-token episodes, in episodes/s.

Default: compares the packed encoding (int32 ids, uint8 mask, float64 logprobs in a BLOB)
against the same queue storing plain pydantic JSON (the naive baseline), and a
zlib-compressed packed variant, all in this run.

`--backends`: the same workload on each queue backend (bench_queue_backends.py): SQLite
(synchronous NORMAL and FULL) against Redis (a redis-server started here, AOF with appendfsync
everysec and always), rounds alternating between them, ratios against SQLite NORMAL.

    python bench/bench_queue.py [--episodes 512] [--tokens 4096] [--group-size 8]
    python bench/bench_queue.py --backends [--rounds 3] [--producers 1]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import zlib
from pathlib import Path

import miles_env.queue.sqlite as mq
from miles_env.types import Episode, Reward, Status, Trajectory, Turn


def make_episodes(n: int, tokens: int, group_size: int) -> list[Episode]:
    rng = random.Random(0)
    out = []
    prompt = tokens // 4
    for i in range(n):
        mask = [0] * prompt + [1] * (tokens - prompt)
        traj = Trajectory(
            token_ids=[rng.randrange(49152) for _ in range(tokens)],
            loss_mask=mask,
            logprobs=[0.0 if m == 0 else -rng.random() * 3 for m in mask],
            turns=[
                Turn(start=prompt, prompt_len=prompt, completion_len=tokens - prompt, finish_reason="stop")
            ],
        )
        out.append(
            Episode(id=f"e{i}", task_id=f"t{i // group_size}", env="bench", group_id=f"g{i // group_size}",
                    status=Status.COMPLETED, reward=Reward(score=rng.random()), samples=[traj])
        )  # fmt: skip
    return out


def naive_encode(ep: Episode) -> tuple[str, bytes]:
    return ep.model_dump_json(), b""


def naive_decode(meta: str, blob: bytes) -> Episode:
    return Episode.model_validate_json(meta)


def zlib_encode(ep: Episode) -> tuple[str, bytes]:
    meta, blob = PACKED[0](ep)
    return meta, zlib.compress(blob, 1)


def zlib_decode(meta: str, blob: bytes) -> Episode:
    return PACKED[1](meta, zlib.decompress(blob))


PACKED = (mq.encode_episode, mq.decode_episode)
CODECS = {
    "packed (ours)": PACKED,
    "packed+zlib": (zlib_encode, zlib_decode),
    "json (naive)": (naive_encode, naive_decode),
}


def run(name: str, episodes: list[Episode], group_size: int) -> dict[str, float]:
    mq.encode_episode, mq.decode_episode = CODECS[name]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as d:
        q = mq.SqliteReplayQueue(Path(d) / "queue.db", group_size=group_size, max_pending_groups=10**6)
        t0 = time.perf_counter()
        for ep in episodes:
            q.put(ep, block=False)
        t1 = time.perf_counter()
        got = 0
        while True:
            leases = q.take(4)
            if not leases:
                break
            got += sum(len(lease.episodes) for lease in leases)
            q.ack(leases)
        t2 = time.perf_counter()
        assert got == len(episodes)
        size = sum(p.stat().st_size for p in Path(d).iterdir())
        q.close()
    n = len(episodes)
    return {
        "put": n / (t1 - t0),
        "take+ack": n / (t2 - t1),
        "total": n / (t2 - t0),
        "kb_per_ep": size / n / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--backends", action="store_true", help="compare SQLite and Redis (packed codec)")
    ap.add_argument("--rounds", type=int, default=3, help="--backends: alternating rounds (median)")
    ap.add_argument("--producers", type=int, default=1, help="--backends: threads putting at once")
    args = ap.parse_args()
    episodes = make_episodes(args.episodes, args.tokens, args.group_size)
    if args.backends:
        from bench_queue_backends import compare

        compare(episodes, args.group_size, rounds=args.rounds, producers=args.producers)
        return
    results = {name: run(name, episodes, args.group_size) for name in CODECS}
    mq.encode_episode, mq.decode_episode = PACKED
    base = results["json (naive)"]["total"]
    print(f"{args.episodes} episodes x {args.tokens} tokens, group_size {args.group_size}")
    print(
        f"{'codec':16} {'put ep/s':>10} {'take+ack ep/s':>14} {'total ep/s':>11} {'KiB/ep':>8} {'vs json':>8}"
    )
    for name, r in results.items():
        print(f"{name:16} {r['put']:10.0f} {r['take+ack']:14.0f} {r['total']:11.0f} {r['kb_per_ep']:8.1f} "
              f"{r['total'] / base:7.1f}x")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
