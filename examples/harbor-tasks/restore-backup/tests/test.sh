#!/bin/bash
# Reward 1 only when every file matches its backup checksum again, no file was added or
# removed, and /app/restored.txt names exactly the files that had been corrupted.
mkdir -p /logs/verifier
cd /app/site || { echo 0 > /logs/verifier/reward.txt; exit 0; }
if sha256sum --quiet -c /app/backups/SHA256SUMS \
   && [ "$(find . -type f | sort | sed 's#^\./##')" = "$(cut -c67- /app/backups/SHA256SUMS | sort)" ] \
   && [ "$(cat /app/restored.txt 2>/dev/null)" = "$(cat /tests/corrupted.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
