#!/bin/bash
# Find the files whose checksum no longer matches; extract just those from the archive.
set -euo pipefail
export LC_ALL=C
cd /app/site
{ sha256sum -c /app/backups/SHA256SUMS 2>/dev/null || true; } \
  | sed -n 's/: FAILED$//p' | sort > /app/restored.txt
while read -r f; do
  tar -xzf /app/backups/site.tar.gz -C /app/site "./$f"
done < /app/restored.txt
