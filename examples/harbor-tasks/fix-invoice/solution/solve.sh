#!/bin/bash
# The discount is a percentage of the line, not an amount: take discount_pct % off the gross.
set -euo pipefail
cd /app
sed -i 's|return gross - discount_pct .*|return gross * (1 - discount_pct / 100)|' src/calc/__init__.py
grep -q 'gross \* (1 - discount_pct / 100)' src/calc/__init__.py
