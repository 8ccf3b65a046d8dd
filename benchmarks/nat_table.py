"""NAT at 50% of the tokens (URS and RPC) against full-token GRPO: held-out accuracy and forward/backward cost.

    python benchmarks/nat_table.py                  # 3 seeds x 3 arms (about 90 s each on 2 cores) + the table
    python benchmarks/nat_table.py --report-only    # rebuilds the table from the CSV

The claims ("Not All Tokens Are Needed"): GRPO's loss on a random 50% of the generated tokens, reweighted by
1 / P(kept), matches full-token GRPO; random prefix cutting (RPC) saves 18% peak GPU memory and 29% forward+backward
time on an 8B model. Arms (algos/nat.py, one file, so everything but the selector is the same code):
  full   --selector full                   every token (the same loss and gradient as algos/grpo.py)
  urs    --selector urs --keep-prob 0.5    each token kept with probability 1/2
  rpc    --selector rpc --keep-prob 0.5    a random prefix, half of each completion on average
The default setting (tiny-0.6m, 2-digit addition, 32 prompts x 8 completions, lr 1e-4), shortened to STEPS rollout
batches, with --micro-batch-size 32 in every arm (RPC's saving comes from cutting each micro-batch at its longest
kept prefix, so it needs micro-batches smaller than the rollout batch). Times are medians over the rollout
batches of one run; the ratio against full is taken per seed, between runs of the same invocation. On CPU peak
memory is not measured: `positions` is the number of token positions (prompt + completion columns, per sequence)
through the forward and backward of one rollout batch, what compute scales with; `peak positions` those of the
widest micro-batch of a rollout batch (mean over rollout batches), what peak activation memory scales with, since
micro-batches run one after another. RPC sorts a mini-batch by kept length, longest first, so its first
micro-batch holds the longest kept prefixes, often as wide as full's widest.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): the peak-positions row, rpc 50% < full, is a
paired t test on the per-seed differences of `--arms "rpc 50%" full --seeds 20 21 22`.

Writes benchmarks/results/nat.csv (rows through benchmarks/_results.py) and nat.md.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, fresh_run_tables, mean_std, read_rows,  # noqa: E402
                                 split_runs)

CSV, NAME = "nat.csv", "nat"
ARMS = {"full": ("full", 1.0), "urs 50%": ("urs", 0.5), "rpc 50%": ("rpc", 0.5)}
PLAN_RUNS = ((10, 19), (20, 22), (100, 241), (300, 481))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
STEPS = 20
FLAGS = dict(steps=STEPS, eval_every=STEPS, eval_examples=300, pass_k=0, eval_hard=False, micro_batch_size=32,
             threads=1)


def run(seeds, arms=tuple(ARMS)) -> None:
    from algos import nat

    for seed in seeds:
        for label, (selector, p) in ARMS.items():
            if label not in arms:
                continue
            args = nat.Args(selector=selector, keep_prob=p, seed=seed, out_dir=f"runs/bench_nat/s{seed}",
                            exp_name=selector, **FLAGS)
            s = nat.main(args)
            cmd = (f"python algos/nat.py --selector {selector} --keep-prob {p} --steps {STEPS} --eval-every {STEPS} "
                   f"--eval-examples 300 --pass-k 0 --no-eval-hard --micro-batch-size 32 --threads 1 --seed {seed}")
            append_rows(CSV, "nat", "algos/nat.py", label, seed, s, cmd)


def fmt(vals, scale=100.0, digits=1):
    return mean_std(vals, scale, digits)


def report() -> None:
    by, meta = defaultdict(dict), {}  # config -> seed -> metrics (a later row wins)
    for r in read_rows(CSV):
        by[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        meta[r["config"]] = r
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    for runs in by.values():
        for r in runs.values():
            r["fwd_bwd_s_per_step"] = r["forward_s_per_step"] + r["backward_s_per_step"]
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    lines = ["| arm | kept tokens % | held-out acc start | end | best | fwd+bwd s / step (x full) | "
             "backward s / step (x full) | positions / step (x full) | peak positions / step (x full) | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    full = by.get("full", {})
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731

        def ratio(key):
            return [runs[s][key] / full[s][key] for s in runs if s in full and key in runs[s] and key in full[s]]

        lines.append(f"| {label} | {fmt(get('kept_frac'))} | {fmt(get('eval_acc_start'))} | {fmt(get('eval_acc_end'))} | "
                     f"{fmt(get('eval_acc_best'))} | {fmt(get('fwd_bwd_s_per_step'), 1, 2)} "
                     f"({fmt(ratio('fwd_bwd_s_per_step'), 1, 2)}) | {fmt(get('backward_s_per_step'), 1, 2)} "
                     f"({fmt(ratio('backward_s_per_step'), 1, 2)}) | {fmt(get('positions_per_step'), 1, 0)} "
                     f"({fmt(ratio('positions_per_step'), 1, 2)}) | {fmt(get('peak_positions_per_step'), 1, 0)} "
                     f"({fmt(ratio('peak_positions_per_step'), 1, 2)}) | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Mean ± std over seeds. `add` (2-digit addition), tiny-0.6m, {STEPS} rollout batches of 32 prompts x 8 "
              f"completions, lr 1e-4, micro-batches of 32 in every arm, 300 held-out prompts, greedy. Times: median "
              f"per rollout batch within a run, the ratio against full per seed (same invocation, one after the other); "
              f"wall-clock on a shared CPU, so a ratio is the figure to read, not the seconds. Positions: token "
              f"positions through forward and backward per rollout batch (compute scales with it); peak positions: "
              f"those of the widest micro-batch (on CPU peak memory is not measured; peak activation memory scales "
              f"with this count). Hardware: {row['hardware']} (shared); {row['versions']}; "
              f"commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/nat_table.py`."]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("fwd+bwd s / step", "fwd_bwd_s_per_step", 1, 2),
            ("positions / step", "positions_per_step", 1, 0),
            ("peak positions / step", "peak_positions_per_step", 1, 0)]
    lines += fresh_run_tables(parts[1:], cols, ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to run (default: all)")
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
