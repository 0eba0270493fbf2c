#!/bin/bash
mkdir -p /app/out
echo "hello harbor" > /app/out/hello.txt
