"""Exit 0 when REPORT holds the top three 5xx clients of every log in LOG_DIR (gzip or not)."""

import collections
import gzip
import sys
from pathlib import Path


def main(log_dir: str, report: str) -> int:
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(Path(log_dir).glob("access-*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as fh:
            for line in fh:
                parts = line.split()
                if parts[-2].startswith("5"):
                    counts[parts[0]] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    want = [f"{ip} {n}" for ip, n in ranked]
    try:
        got = Path(report).read_text().strip().splitlines()
    except OSError as e:
        print(f"no report: {e}")
        return 1
    if [g.strip() for g in got] != want:
        print(f"report {got!r}, want {want!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
