"""Regenerate BENCHMARKS.md: bench/header.md (the learning runs) + every bench/results/*.md.

Run: python bench/make_benchmarks_md.py. Each results file is written by hand from one benchmark
run (with its command); headings are demoted one level so they nest under the header.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    out = (ROOT / "bench" / "header.md").read_text().rstrip("\n").splitlines() + [""]
    for f in sorted((ROOT / "bench" / "results").glob("*.md")):
        lines = f.read_text().strip().splitlines()
        out += [("#" + line) if line.startswith("#") else line for line in lines] + [""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(out) + "\n")
    print(f"BENCHMARKS.md: {len(out)} lines from {ROOT / 'bench' / 'results'}")


if __name__ == "__main__":
    main()
