#!/bin/sh
# Thread scaling of the host forward pass, wall clock: interleaved rounds of the release
# `throughput` example at each thread count on the embedded model, each cell's best round,
# and each thread count's ratio to the first one.
#
#   model/benches/scaling.sh [ROUNDS [WORK [THREADS...]]]
#   (defaults: 6 rounds, prefill:128,prefill:2048,decode:1,decode:32, threads 1 2)
#
# A thread count written `2x1` runs two 1-thread processes at the same time and adds their
# rates: what two cores give when nothing is shared but the machine (memory bandwidth, caches,
# clock), the ceiling any 2-thread split of one forward pass can reach on this machine.
#
# A thread count written `TjJ` (e.g. `2j1`) runs T threads with `--jobs-per-thread J` (no job
# is more than 1/(J x T) of its region; the default is 8), to compare the split of the regions.
#
# For a ratio that the machine's drift between rounds hurts less, use the example's in-process
# `--compare` (e.g. `throughput --compare 1,2,2x1 --rounds 15 --work prefill:2048,decode:32`:
# the settings alternate over the same inputs in one process, with the median and quartiles of
# the per-round ratios, and it checks that every setting gives the same logits bits).
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
        case $t in
        *x1)
            # Each process's best round is kept per item, and the processes' rates are added.
            pair=$(mktemp)
            i=0
            while [ "$i" -lt "${t%x1}" ]; do
                "$BIN" --threads 1 --work "$WORK" --repeat 2 >"$pair.$i" &
                i=$((i + 1))
            done
            wait
            cat "$pair".* | awk -v t="$t" '
                { key = $1 " " $2; if (!(key in sum)) order[++n] = key; sum[key] += $4 }
                END { for (j = 1; j <= n; j++) print t, order[j], sum[order[j]] }' >>"$LOG"
            rm -f "$pair" "$pair".*
            ;;
        *j*)
            "$BIN" --threads "${t%j*}" --jobs-per-thread "${t#*j}" --work "$WORK" --repeat 2 |
                while read -r kind n _ rate; do
                    echo "$t $kind $n $rate"
                done >>"$LOG"
            ;;
        *)
            "$BIN" --threads "$t" --work "$WORK" --repeat 2 | while read -r kind n _ rate; do
                echo "$t $kind $n $rate"
            done >>"$LOG"
            ;;
        esac
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
