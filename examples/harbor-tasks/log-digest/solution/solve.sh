#!/bin/bash
# Every log, compressed or not; field 9 is the status; count per IP, most first, ties by IP.
set -euo pipefail
export LC_ALL=C
cd /app
mkdir -p report
zcat -f logs/access-* \
  | grep -E '" 5[0-9]{2} [0-9]+$' \
  | cut -d' ' -f1 | sort | uniq -c \
  | sort -k1,1nr -k2,2 | head -n 3 \
  | sed -E 's/^ *([0-9]+) (.*)$/\2 \1/' > report/top_errors.txt
