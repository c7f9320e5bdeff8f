#!/bin/sh
# BullMQ 5 beside shardq: `benchmarks/peers/bullmq/run.sh redis://127.0.0.1:PORT/0 JOBS [CONCURRENCY]`
# (benchmarks/bench.py http --backend redis --bullmq starts the redis-server and calls this script's bench.mjs).
set -e
cd "$(dirname "$0")"
[ -d node_modules ] || npm ci --silent
exec node bench.mjs "$@"
