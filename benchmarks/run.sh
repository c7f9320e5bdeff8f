#!/bin/sh
# One-line runners for the "From any language" figures in BENCHMARKS.md.
# Loopback only; temporary data dirs; the release binary (built if missing).
#
#   benchmarks/run.sh stdio        # work --stdio (Python handler) vs work -- true, pipeline 1, 4, 8
#   benchmarks/run.sh http         # Python producer -> shardq serve (embedded) -> Python workers
#   benchmarks/run.sh http-redis   # the same on one redis-server, beside BullMQ 5 on that server
#   benchmarks/run.sh latency      # enqueue-to-start p50/p99 at a paced 5k jobs/s
#   benchmarks/run.sh all
#
# Extra arguments go to benchmarks/bench.py (e.g. --repeat 2 --jobs 50000).
set -e
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/.."
[ -x target/release/shardq ] || cargo build --release -p shardq
what="${1:-all}"
[ $# -gt 0 ] && shift
case "$what" in
  stdio) exec python3 "$here/bench.py" stdio "$@" ;;
  http) exec python3 "$here/bench.py" http --backend embedded "$@" ;;
  http-redis) exec python3 "$here/bench.py" http --backend redis --bullmq "$@" ;;
  latency) exec python3 "$here/bench.py" latency --rate 5000 "$@" ;;
  all)
    python3 "$here/bench.py" stdio "$@"
    python3 "$here/bench.py" http --backend embedded "$@"
    python3 "$here/bench.py" http --backend redis --bullmq "$@"
    python3 "$here/bench.py" latency --rate 5000 "$@"
    ;;
  *) echo "usage: benchmarks/run.sh stdio|http|http-redis|latency|all [bench.py options]" >&2; exit 2 ;;
esac
