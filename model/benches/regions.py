#!/usr/bin/env python3
"""Where a forward pass's wall time goes, parallel region by parallel region.

    cargo build --release -p model --example throughput --features region-timing
    target/release/examples/throughput --threads 2 --work prefill:2048,decode:32 --regions > t2.txt
    model/benches/regions.py t2.txt [more runs of the same build and thread count...]

Adds up the `region` lines of `throughput --regions` (see `model::regions`) over the files, per
work item and region (source line of the fork, and shape for a matrix product), and prints per
region, per forward call: calls, wall time (fork to join), its share of the item's time
(regions and the serial code between them), the serial time before it, and the fractions of
threads x wall time the threads spent busy in tasks, waiting for their first task (wake-up or
steal latency), waiting after their last task for the join (imbalance), and otherwise idle
(between tasks, or the whole region for a thread that ran none of its tasks). Compare the
tables of a 1-thread and a 2-thread run to see which regions scale worst.
"""
import collections
import sys


def main(paths):
    agg = collections.defaultdict(lambda: collections.defaultdict(float))
    threads = 1
    for path in paths:
        with open(path) as file:
            for line in file:
                fields = line.split()
                if not fields or fields[0] != "region":
                    continue
                key = (fields[1], fields[2], fields[3])
                values, thread, rest = agg[key], None, fields[4:]
                i = 0
                while i < len(rest):
                    name = rest[i]
                    if name[0] == "t" and name[1:].isdigit():
                        thread = int(name[1:])
                        threads = max(threads, thread + 1)
                        i += 1
                        continue
                    values[(thread, name)] += float(rest[i + 1])
                    i += 2
    for item in sorted({key[0] for key in agg}):
        rows = [(key, values) for key, values in agg.items() if key[0] == item]
        total = sum(v[(None, "wall_us")] + v[(None, "serial_us")] for _, v in rows)
        calls = sum(v[(None, "calls")] for key, v in rows if key[1] == "forward_end") or 1
        print(f"== {item}: {calls:.0f} forward calls, {total / 1e3 / calls:.2f} ms each, "
              f"{threads} thread(s)")
        print(f"{'region':24s} {'shape':16s} {'calls':>6s} {'ms':>8s} {'share':>6s} "
              f"{'serial':>7s} {'busy':>6s} {'delay':>6s} {'wait':>6s} {'idle':>6s}")
        busy_all = capacity_all = 0.0
        rows.sort(key=lambda kv: -(kv[1][(None, "wall_us")] + kv[1][(None, "serial_us")]))
        for key, v in rows:
            wall, serial = v[(None, "wall_us")], v[(None, "serial_us")]
            line = (f"{key[1].replace('model/src/', ''):24s} {key[2]:16s} "
                    f"{v[(None, 'calls')] / calls:6.1f} {wall / 1e3 / calls:8.3f} "
                    f"{(wall + serial) / total:6.1%} {serial / 1e3 / calls:7.3f}")
            capacity = threads * wall
            if capacity:
                parts = [sum(v[(t, name)] for t in range(threads)) / capacity
                         for name in ("busy_us", "delay_us", "wait_us")]
                parts.append(1 - sum(parts))
                line += "".join(f" {part:6.1%}" for part in parts)
                busy_all += parts[0] * capacity
                capacity_all += capacity
            print(line)
        serial_all = sum(v[(None, "serial_us")] for _, v in rows)
        print(f"all regions: busy {busy_all / max(capacity_all, 1):.1%} of threads x wall; "
              f"serial {serial_all / total:.1%} of the item's time")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
