"""`python3 -m calc.build RATES.csv OUT.json`: the region -> tax-rate table `calc` reads."""

import csv
import json
import sys
from pathlib import Path


def main(src: str, dst: str) -> None:
    with open(src, newline="") as fh:
        table = {row["region"]: row["rate"] for row in csv.DictReader(fh)}
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(json.dumps(table, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
