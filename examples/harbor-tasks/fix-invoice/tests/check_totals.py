"""Totals of invoices the agent never saw, computed by hand, against `python3 -m calc`."""

import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = """invoice,region,qty,price,discount_pct
X-1,north,1,50.00,10
X-2,south,2,19.99,
X-3,export,3,10.00,33
X-3,export,1,1.00,0
X-4,north,5,8.00,100
"""
# 45.00 * 1.20; X-2: 39.98 * 1.10; X-3: 20.10 + 1.00; X-4: 0
WANT = ["X-1 54.00", "X-2 43.98", "X-3 21.10", "X-4 0.00"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hidden.csv"
        path.write_text(HIDDEN)
        res = subprocess.run([sys.executable, "-m", "calc", str(path)], capture_output=True, text=True)
    got = res.stdout.strip().splitlines()
    if res.returncode != 0 or got != WANT:
        print(f"exit {res.returncode}: {got!r}, want {WANT!r}\n{res.stderr[-500:]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
