#!/bin/sh
# Thread scaling of the host forward pass, wall clock: interleaved rounds of the release
# `throughput` example at each thread count on the embedded model, each cell's best round,
# and each thread count's ratio to the first one.
#
#   model/benches/scaling.sh [ROUNDS [WORK [THREADS...]]]
#   (defaults: 6 rounds, prefill:128,prefill:2048,decode:1,decode:32, threads 1 2)
#
# Run it on an idle machine (`uptime` load well under the core count): the per-core speed of a
# shared machine varies by tens of percent between rounds, which interleaving and best-of only
# partly absorb. Raw lines go to stderr, the table to stdout.
set -eu
cd "$(dirname "$0")/../.."
ROUNDS=${1:-6}
WORK=${2:-prefill:128,prefill:2048,decode:1,decode:32}
[ $# -gt 2 ] && shift 2 && THREADS="$*" || THREADS="1 2"
cargo build --release -q -p model --example throughput
BIN=${CARGO_TARGET_DIR:-target}/release/examples/throughput
LOG=$(mktemp)
round=1
while [ "$round" -le "$ROUNDS" ]; do
    for t in $THREADS; do
        "$BIN" --threads "$t" --work "$WORK" --repeat 2 | while read -r kind n _ rate; do
            echo "$t $kind $n $rate"
        done >>"$LOG"
    done
    echo "round $round of $ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    round=$((round + 1))
done
cat "$LOG" >&2
awk -v threads="$THREADS" '
    { key = $2 " " $3; if (!(key in order)) { order[key] = ++n; keys[n] = key }
      if ($4 > best[$1, key]) best[$1, key] = $4 }
    END {
        k = split(threads, ts, " ")
        printf "%-14s", "tok/s (best)"; for (i = 1; i <= k; i++) printf "%12s", ts[i] " thr"
        for (i = 2; i <= k; i++) printf "%12s", ts[i] "t/" ts[1] "t"; printf "\n"
        for (j = 1; j <= n; j++) {
            printf "%-14s", keys[j]
            for (i = 1; i <= k; i++) printf "%12.1f", best[ts[i], keys[j]]
            for (i = 2; i <= k; i++) printf "%12.2f", best[ts[i], keys[j]] / best[ts[1], keys[j]]
            printf "\n"
        }
    }' "$LOG"
rm -f "$LOG"
