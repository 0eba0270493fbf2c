"""Rewrite `--count` seeded files of the site in place (same size, flipped bytes)."""

import argparse
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--site", required=True)
    ap.add_argument("--count", type=int, required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed * 7919)
    files = sorted(p for p in Path(args.site).rglob("*") if p.is_file())
    for path in rng.sample(files, args.count):
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data) // 2, len(data) - 1)
        data[at] = ord("#") if data[at] != ord("#") else ord("%")
        path.write_bytes(bytes(data))


if __name__ == "__main__":
    main()
