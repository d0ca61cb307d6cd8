#!/usr/bin/env python3
"""Host model vs Hugging Face transformers (PyTorch CPU) on the same checkpoint, in one run.

Builds the replay's embedded model (`Config::small_512()`, seed 0) as a safetensors checkpoint
with `cargo run --release -p model --example throughput -- --save DIR`, then, for each round and
each thread count, runs our `throughput` example and transformers on it one after the other
(interleaved, each pinned with `taskset` to the first N cores; torch with `OMP_NUM_THREADS=N`
and `OMP_WAIT_POLICY=PASSIVE`), keeps each cell's best round, checks parity (final-position
logits of the longest prefill), and prints a table with the ratios.

Needs `torch` and `transformers` (5.x, which has NemotronH) from PyPI in a virtual environment
outside the repository, e.g.:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors
    /tmp/hf/bin/python model/benches/vs_transformers.py --threads 1,2 --rounds 3

Workloads (the same prompts on both sides): `prefill:N` is one prompt of N tokens (tok/s of the
forward pass; transformers computes only the last position's logits); `decode:B` is B sequences
of 128 prompt tokens decoded greedily for `--steps` steps together (tok/s = B * steps / time of
the steps, prefill excluded). On a shared machine, run the whole script under `nice -n -15` (as
root) so that both sides get the cores they are pinned to.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECODE_CONTEXT = 128
DEFAULT_WORK = "prefill:128,prefill:512,prefill:2048,decode:1,decode:8,decode:32"


def prompt(length, seed, vocab):
    """The prompt formula of `model/examples/throughput.rs`."""
    return [(t * 31 + seed * 7 + 3) % vocab for t in range(length)]


def parse_work(text):
    items = []
    for item in text.split(","):
        kind, n = item.split(":")
        if kind not in ("prefill", "decode") or int(n) < 1:
            raise SystemExit(f"bad --work item {item!r}")
        items.append((kind, int(n)))
    return items


def cores(threads):
    return ",".join(str(c) for c in range(threads))


# ---------------------------------------------------------------- transformers side (a subprocess)


def hf_worker(args):
    """Runs inside `taskset`, with the OMP variables set by the parent; prints JSON lines."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        """Records when each generation step's logits are ready."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    torch.set_num_threads(args.hf_threads)
    model = AutoModelForCausalLM.from_pretrained(args.hf_worker, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    results = {}
    with torch.inference_mode():
        for kind, n in parse_work(args.work):
            best = 0.0
            for _ in range(args.repeat):
                if kind == "prefill":
                    ids = torch.tensor([prompt(n, 0, vocab)])
                    started = time.perf_counter()
                    out = model(ids, use_cache=False, logits_to_keep=1)
                    rate = n / (time.perf_counter() - started)
                    if args.logits:
                        out.logits[0, -1].float().numpy().tofile(args.logits)
                else:
                    ids = torch.tensor([prompt(DECODE_CONTEXT, s + 1, vocab) for s in range(n)])
                    # The processor runs once per generated token, right after that token's
                    # forward pass: from its first call (after the prompt's forward) to its last,
                    # exactly `steps` decode steps ran.
                    clock = Clock()
                    model.generate(
                        ids,
                        max_new_tokens=1 + args.steps,
                        min_new_tokens=1 + args.steps,
                        do_sample=False,
                        use_cache=True,
                        pad_token_id=0,
                        logits_processor=LogitsProcessorList([clock]),
                    )
                    rate = n * args.steps / (clock.times[-1] - clock.times[0])
                best = max(best, rate)
            results[f"{kind} {n}"] = best
    print(json.dumps(results))


def run_hf(checkpoint, threads, work, steps, repeat, logits=None):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE",
               MKL_NUM_THREADS=str(threads))
    command = ["taskset", "-c", cores(threads), sys.executable, __file__, "--hf-worker",
               str(checkpoint), "--hf-threads", str(threads), "--work", work, "--steps",
               str(steps), "--repeat", str(repeat)]
    if logits:
        command += ["--logits", str(logits)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- our side


def run_ours(binary, checkpoint, threads, work, steps, repeat, logits=None):
    command = ["taskset", "-c", cores(threads), str(binary), "--model", str(checkpoint),
               "--threads", str(threads), "--work", work, "--steps", str(steps), "--repeat",
               str(repeat)]
    if logits:
        command += ["--logits", str(logits)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    results = {}
    for line in out.splitlines():
        kind, n, _, rate = line.split()
        results[f"{kind} {n}"] = float(rate)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    parser.add_argument("--work", default=DEFAULT_WORK)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per round")
    parser.add_argument("--checkpoint", help="use this checkpoint instead of the embedded model")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--binary", help="our throughput example, already built (default: build)")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf-threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args)

    if args.binary:
        binary = Path(args.binary)
    else:
        subprocess.run(["cargo", "build", "--release", "-p", "model", "--example", "throughput"],
                       cwd=ROOT, check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        binary = target / "release" / "examples" / "throughput"
    scratch = Path(tempfile.mkdtemp(prefix="vs-transformers-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else scratch / "small_512"
    if not args.checkpoint:
        subprocess.run([str(binary), "--save", str(checkpoint)], check=True, capture_output=True)

    # Parity first: the final-position logits of the longest prefill, both sides.
    longest = max((n for kind, n in parse_work(args.work) if kind == "prefill"), default=128)
    import numpy as np

    ours_logits, hf_logits = scratch / "ours.f32", scratch / "hf.f32"
    run_ours(binary, checkpoint, 1, f"prefill:{longest}", args.steps, 1, ours_logits)
    run_hf(checkpoint, 1, f"prefill:{longest}", args.steps, 1, hf_logits)
    a, b = np.fromfile(ours_logits, dtype="<f4"), np.fromfile(hf_logits, dtype="<f4")
    parity = float(np.abs(a - b).max())
    same_argmax = int(a.argmax()) == int(b.argmax())
    print(f"parity: prefill {longest}, final position: max |dlogit| {parity:.2e}, "
          f"argmax {'equal' if same_argmax else 'DIFFERS'}", flush=True)

    threads = [int(t) for t in args.threads.split(",")]
    best = {}
    for round_index in range(args.rounds):
        for t in threads:
            for side, run in (("ours", run_ours), ("transformers", run_hf)):
                if side == "ours":
                    figures = run_ours(binary, checkpoint, t, args.work, args.steps, args.repeat)
                else:
                    figures = run_hf(checkpoint, t, args.work, args.steps, args.repeat)
                for name, rate in figures.items():
                    key = (side, t, name)
                    best[key] = max(best.get(key, 0.0), rate)
                print(f"round {round_index + 1} {side} {t} thread(s): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)

    names = [f"{kind} {n}" for kind, n in parse_work(args.work)]
    header = "| workload (tok/s) |"
    rule = "|---|"
    for t in threads:
        header += f" ours {t}t | transformers {t}t | ratio {t}t |"
        rule += "---|---|---|"
    if len(threads) > 1:
        header += f" ours {threads[-1]}t / {threads[0]}t |"
        rule += "---|"
    print(header)
    print(rule)
    for name in names:
        line = f"| {name} |"
        for t in threads:
            ours, theirs = best[("ours", t, name)], best[("transformers", t, name)]
            line += f" {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |"
        if len(threads) > 1:
            scale = best[("ours", threads[-1], name)] / best[("ours", threads[0], name)]
            line += f" {scale:.2f} |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "parity_max_abs": parity,
            "argmax_equal": same_argmax,
            "figures": [{"side": s, "threads": t, "workload": n, "tok_s": v}
                        for (s, t, n), v in sorted(best.items())],
        }, indent=2))


if __name__ == "__main__":
    main()
