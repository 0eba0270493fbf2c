#!/bin/bash
# Reward 1 only when /app/report/top_errors.txt is exactly the top three 5xx clients, counted
# here from the logs, and the logs are the ones the image was built with.
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
if sha256sum --quiet -c /app/.logs.sha256 && python3 /tests/check_report.py /app/logs /app/report/top_errors.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
