"""Invoice totals: sum of lines, each `qty * price` less its discount, plus the region's tax."""

import csv
import json
import os
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

CENT = Decimal("0.01")


def rates() -> dict[str, Decimal]:
    """The tax table `python3 -m calc.build` wrote (region -> rate)."""
    table = json.loads(Path(os.environ.get("CALC_TABLE", "/app/build/rates.json")).read_text())
    return {region: Decimal(rate) for region, rate in table.items()}


def line_total(qty: int, price: Decimal, discount_pct: Decimal) -> Decimal:
    gross = qty * price
    return gross - discount_pct  # the discount is a percentage of the line


def totals(path: str) -> dict[str, Decimal]:
    table = rates()
    out: dict[str, Decimal] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            net = line_total(int(row["qty"]), Decimal(row["price"]), Decimal(row["discount_pct"] or "0"))
            taxed = net * (1 + table[row["region"]])
            out[row["invoice"]] = out.get(row["invoice"], Decimal(0)) + taxed
    return {k: v.quantize(CENT, rounding=ROUND_HALF_UP) for k, v in out.items()}
