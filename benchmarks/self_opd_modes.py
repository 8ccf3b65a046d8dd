"""PW-OPSD / TRACE: self-distillation modes side by side (algos/self_opd.py, every other setting at its default).

    python benchmarks/self_opd_modes.py                  # 6 configurations x 3 seeds, about 12 minutes
    python benchmarks/self_opd_modes.py --report-only    # rebuild the table from the committed CSV
    python benchmarks/report.py                          # paste it into README.md

The claims under test: position-weighted OPSD beats uniform (all-token) OPSD ("When Are Teacher Tokens
Reliable? Position-Weighted On-Policy Self-Distillation for Reasoning", arXiv:2605.21606); all-token
self-distillation raises entropy, shortens outputs and hurts out-of-distribution accuracy, while critical-span
routing does not ("TRACE: Distilling Where It Matters via Token-Routed Self On-Policy Alignment",
arXiv:2605.10194). Out of distribution = one digit more than training.
Rows: benchmarks/results/self_opd.csv; table: benchmarks/results/self_opd.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 metric_lists, read_rows, split_runs)

CSV = "self_opd.csv"
PLAN_RUNS = ((10, 19),)  # the claims plan's fresh run (benchmarks/claims_plan.csv)
# (config name, --mode, overrides): the four modes at the script's defaults, then TRACE and GRPO at the GRPO
# settings of algos/grpo.py (lr 1e-4, 8 samples per prompt), since the defaults are chosen for distillation.
CONFIGS = [("opsd", "opsd", {}), ("pw-opsd", "pw-opsd", {}), ("trace", "trace", {}), ("grpo", "grpo", {}),
           ("trace-grpo-settings", "trace", {"lr": 1e-4, "group_size": 8}),
           ("grpo-grpo-settings", "grpo", {"lr": 1e-4, "group_size": 8})]
LABELS = {"opsd": "all-token OPSD", "pw-opsd": "position-weighted OPSD",
          "trace": "TRACE span routing", "grpo": "GRPO (no distillation)",
          "trace-grpo-settings": "TRACE, lr 1e-4, 8 samples", "grpo-grpo-settings": "GRPO, lr 1e-4, 8 samples"}


def flags(mode, over):
    return f"--mode {mode}" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in over.items())


def run(seeds, configs) -> None:
    from algos import self_opd

    done = {(r["config"], int(r["seed"])) for r in read_rows(CSV)}  # resumable
    for seed in seeds:
        for name, mode, over in CONFIGS:
            if (name, seed) in done or name not in configs:
                continue
            s = self_opd.main(self_opd.Args(mode=mode, seed=seed, out_dir=f"runs/bench_self_opd/{name}_s{seed}",
                                            **over))
            append_rows(CSV, "self_opd", "algos/self_opd.py", name, seed, s,
                        f"python algos/self_opd.py {flags(mode, over)} --seed {seed}")


def fmt(vals, scale=1.0, nd=1):
    return mean_std(vals, scale, nd)


def report() -> None:
    seeds, last = by_config_seed(CSV)  # config -> seed -> metrics, and each config's latest row
    meta = max(last.values(), key=lambda r: r["timestamp"]) if last else None
    parts = split_runs(seeds, PLAN_RUNS)
    by = metric_lists(parts[0][1])  # the first run; each fresh run of the claims plan gets its own table
    lines = ["| mode | held-out acc end (%) | gain (points) | 3-digit OOD acc end (%) | OOD change (points) | "
             "entropy first -> last | length first -> last | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for name, mode, over in CONFIGS:
        m = by.get(name)
        if not m:
            continue
        gain = [e - s for s, e in zip(m["eval_acc_start"], m["eval_acc_end"])]
        ood = [e - s for s, e in zip(m.get("eval_acc_hard_start", []), m.get("eval_acc_hard_end", []))]
        lines.append(f"| {LABELS[name]} (`{flags(mode, over)}`) | {fmt(m['eval_acc_end'], 100)} | {fmt(gain, 100)} | "
                     f"{fmt(m.get('eval_acc_hard_end', []), 100)} | {fmt(ood, 100)} | "
                     f"{fmt(m['entropy_first'], nd=3)} -> {fmt(m['entropy_last'], nd=3)} | "
                     f"{fmt(m['length_first'])} -> {fmt(m['length_last'])} | {len(m['eval_acc_end'])} |")
    if meta:
        start = by["opsd"]["eval_acc_start"] if by.get("opsd") else []
        lines += ["", f"`algos/self_opd.py` defaults (tiny-0.6m, 2-digit `add`, the model is its own teacher: the same "
                      f"weights, no gradient, prompted with the worked column-by-column scratchpad up to its final "
                      f"`=`, e.g. `47+85:7+5=12;4+8+1=13;=`, while the student sees `47+85=`), one run per "
                      f"configuration and seed; held-out greedy accuracy starts at "
                      f"{fmt(start, 100)}%. Entropy and length: mean over the first and last 5 rollout batches. "
                      f"Mean ± std over seeds. Hardware: {meta['hardware']}; {meta['versions']}; commit "
                      f"{meta['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                      f"`python benchmarks/self_opd_modes.py`.",
                  "", "Reading it: the first four rows run at this script's lr 2e-4 with 4 samples per prompt, settings "
                      "chosen for distillation, at which GRPO (and TRACE's GRPO channel) is unstable; the last two "
                      "rows use `algos/grpo.py`'s lr 1e-4 and 8 samples (its own 400-batch default gains +27 points, "
                      "defaults table). 2-digit answers are 3-4 tokens, so length cannot "
                      "shrink, and 3-digit accuracy is near zero for every mode: the entropy column is the only one of "
                      "the three leakage symptoms named by TRACE's paper (entropy rise, shorter reasoning, OOD loss) "
                      "that this task can show."]
        cols = [("held-out acc end (%)", "eval_acc_end", 100, 1),
                ("3-digit OOD acc end (%)", "eval_acc_hard_end", 100, 1),
                ("entropy last", "entropy_last", 1, 3)]
        fresh = [(r, {LABELS[c]: d for c, d in p.items()}) for r, p in parts[1:]]  # rows named as in the table above
        lines += fresh_run_tables(fresh, cols, [LABELS[c[0]] for c in CONFIGS])
    (RESULTS / "self_opd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS],
                    help="configurations to run (default: all six)")
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.configs)
    report()
