#!/bin/bash
# Reward 1 only when the package totals unseen invoices right (with and without discounts)
# and the shipped data is unchanged.
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
export PYTHONPATH=/app/src CALC_TABLE=/app/build/rates.json
if sha256sum --quiet -c /tests/data.sha256 && python3 /tests/check_totals.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
