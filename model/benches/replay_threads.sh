#!/bin/sh
# The replay's main job (the default `cargo run --release -p replay`: the embedded model, the
# built-in chat workload) at each thread count, wall clock: interleaved rounds, each cell's best
# round (shortest wall time) with its output and total tokens per second, and each thread count's
# wall-time ratio to the first one.
#
#   model/benches/replay_threads.sh [ROUNDS [THREADS...]]   (defaults: 3 rounds, threads 1 2)
#
# Extra replay options go in REPLAY_ARGS (e.g. REPLAY_ARGS="--max-requests 64"). Run it on an
# idle machine (see scaling.sh). Raw report lines go to stderr, the table to stdout.
set -eu
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
[ $# -gt 1 ] && shift 1 && THREADS="$*" || THREADS="1 2"
cargo build --release -q -p replay
BIN=${CARGO_TARGET_DIR:-target}/release/replay
LOG=$(mktemp)
round=1
while [ "$round" -le "$ROUNDS" ]; do
    for t in $THREADS; do
        # shellcheck disable=SC2086 # REPLAY_ARGS is a list of options
        "$BIN" --threads "$t" --progress off ${REPLAY_ARGS:-} | grep '^throughput' | while read -r _ out _ _ total _ _ _ wall _; do
            echo "$t $wall $out $total"
        done >>"$LOG"
    done
    echo "round $round of $ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    round=$((round + 1))
done
cat "$LOG" >&2
awk -v threads="$THREADS" '
    { if (!($1 in best) || $2 < best[$1]) { best[$1] = $2; out[$1] = $3; total[$1] = $4 } }
    END {
        k = split(threads, ts, " ")
        printf "%-8s %10s %14s %14s %10s\n", "threads", "wall s", "output tok/s", "total tok/s", "speedup"
        for (i = 1; i <= k; i++)
            printf "%-8s %10.2f %14s %14s %10.2f\n", ts[i], best[ts[i]], out[ts[i]], total[ts[i]], best[ts[1]] / best[ts[i]]
    }' "$LOG"
rm -f "$LOG"
