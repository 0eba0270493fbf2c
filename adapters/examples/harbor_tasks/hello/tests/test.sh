#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/out/hello.txt 2>/dev/null)" = "hello harbor" ] && grep -q seed /app/data/seed.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
