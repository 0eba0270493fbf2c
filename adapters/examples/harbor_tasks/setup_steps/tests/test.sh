#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/build/greeting.txt)" = "hello from /app" ] \
   && [ "$(cat /app/out/count.txt 2>/dev/null)" = "$(cat /app/build/expected.txt)" ] \
   && [ "$APP_HOME" = /app ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
