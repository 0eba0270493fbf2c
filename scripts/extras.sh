#!/usr/bin/env bash
# The extras a full install takes (setup.sh, lock.sh): printed comma-separated.
echo "model,train,clients,megatron,docker,cloud,scale,dev"
