#!/usr/bin/env python3
"""Serial part and fork/joins of one forward call, from instruction counts (load-independent).

Run the call under callgrind with one output file per thread, split at the call:

    cargo build --release -p model --example throughput
    valgrind --tool=callgrind --separate-threads=yes --dump-before='model::Model::decode' \\
        --callgrind-out-file=cg.out target/release/examples/throughput --threads 2 \\
        --work step:32 --steps 1 --repeat 1
    model/benches/serial_regions.py cg.out [THREADS]

(`--dump-before='model::Model::prefill' --work chunk:960` for a prefill chunk.) The thread that
enters the most parallel regions from model code is the orchestrating one; what it runs outside
those regions is the serial part. Work is every thread's instructions but the self cost of the
scheduler (rayon, crossbeam, futex and yield calls). The bound at T threads, work / (serial +
parallel / T), assumes each region splits evenly.

Why not each thread's own total: valgrind runs one thread at a time and switches rarely, so
which thread takes which half of a region follows valgrind's scheduler, not the code (the same
build gave a busiest-thread share of 0.58 in one run and 0.74 in another).
"""
import collections
import glob
import re
import sys

SCHEDULER = re.compile(
    r"wait_until|rayon_core::sleep|Sleep::|yield_now|sched_yield|crossbeam_deque|crossbeam_epoch|"
    r"futex|syscall|find_work|steal|pthread_cond|lll_|take_local_job|LockLatch|CountLatch|"
    r"SpinLatch|CoreLatch|notify_worker|wake_any|rayon_core::registry::WorkerThread::wait|"
    r"rayon_core::job::JobFifo|nanosleep")
RAYON = re.compile(r"^<?rayon")


def parse(path):
    """Call edges (caller, callee) -> [calls, inclusive cost] and self cost per function."""
    names = {}
    fn = callee = None
    pending = None
    calls = collections.defaultdict(lambda: [0, 0])
    self_cost = collections.Counter()

    def name(rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "?")

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            if line[0].isdigit() or line[0] in "+-*":
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                if pending:
                    edge = calls[pending[:2]]
                    edge[0] += pending[2]
                    edge[1] += cost
                    pending = None
                else:
                    self_cost[fn] += cost
                continue
            key, _, rest = line.partition("=")
            if key == "fn":
                fn = name(rest)
            elif key == "cfn":
                callee = name(rest)
            elif key == "calls":
                pending = (fn, callee, int(rest.split()[0]))
    return calls, self_cost


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    prefix = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    total, sched, regions, inside = (collections.Counter() for _ in range(4))
    sites = collections.Counter()
    for path in sorted(glob.glob(prefix + "*-*")):
        m = re.search(r"\.out(?:\.(\d+))?-(\d+)$", path)
        # Part 1 (a numbered file) is everything before the first measured call.
        if not m or (m.group(1) and int(m.group(1)) < 2):
            continue
        thread = m.group(2)
        calls, self_cost = parse(path)
        total[thread] += sum(self_cost.values())
        sched[thread] += sum(c for f, c in self_cost.items() if SCHEDULER.search(f or ""))
        for (caller, callee), (count, cost) in calls.items():
            if caller and "model::" in caller and not RAYON.search(caller) and RAYON.search(callee or ""):
                regions[thread] += count
                inside[thread] += cost
                sites[(thread, caller)] += count
    if not total:
        sys.exit(f"no callgrind files {prefix}*-NN")
    orchestrator = max(total, key=lambda t: regions[t])
    work = sum(total[t] - sched[t] for t in total)
    serial = total[orchestrator] - inside[orchestrator]
    print(f"work (all threads, scheduler excluded) {work:,} instructions")
    print(f"serial (thread {orchestrator} outside parallel regions) {serial:,} = {serial / work:.4f} of the work")
    print(f"parallel regions entered {regions[orchestrator]}")
    for (thread, caller), count in sorted(sites.items(), key=lambda kv: -kv[1]):
        if thread == orchestrator:
            print(f"  {count:5d} from {caller}")
    print(f"bound at {threads} threads, regions split evenly: {work / (serial + (work - serial) / threads):.3f}x")


if __name__ == "__main__":
    main()
