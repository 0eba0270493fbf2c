"""Write `--days` access logs (access-1.log newest) of synthetic traffic from a fixed seed."""

import argparse
import random
from pathlib import Path

PATHS = ["/", "/login", "/api/items", "/api/cart", "/static/app.js", "/search?q=x"]
STATUS = [200] * 30 + [301, 304, 404, 404, 500, 502, 503]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--days", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    ips = [f"10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}" for _ in range(40)]
    flaky = ips[:6]  # clients hitting the broken endpoints more often
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for day in range(1, args.days + 1):
        lines = []
        for i in range(1500):
            ip = rng.choice(flaky if rng.random() < 0.25 else ips)
            status = rng.choice(STATUS + ([500, 503] * 3 if ip in flaky else []))
            stamp = f"[{10 + day:02d}/Mar/2026:{i // 100 % 24:02d}:{i % 60:02d}:{i * 7 % 60:02d} +0000]"
            req = f'"{rng.choice(["GET", "GET", "POST"])} {rng.choice(PATHS)} HTTP/1.1"'
            lines.append(f"{ip} - - {stamp} {req} {status} {rng.randint(100, 9000)}\n")
        (out / f"access-{day}.log").write_text("".join(lines))


if __name__ == "__main__":
    main()
