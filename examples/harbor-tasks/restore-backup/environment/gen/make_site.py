"""Write a small site tree (pages, assets, config) with seeded contents."""

import argparse
import random
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.out)
    for section in ("blog", "docs", "assets/css", "config"):
        for i in range(5):
            ext = {"blog": "html", "docs": "md", "assets/css": "css", "config": "ini"}[section]
            path = root / section / f"{rng.choice(WORDS)}-{i}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            path.write_text(f"# {path.name}\n{body}\n")


if __name__ == "__main__":
    main()
