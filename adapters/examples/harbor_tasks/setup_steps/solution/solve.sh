#!/bin/bash
mkdir -p /app/out
count-words /app/data/words.txt > /app/out/count.txt
