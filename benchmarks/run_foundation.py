"""The foundation rows: algos/sft.py and algos/grpo.py on the tiny default, 3 seeds each.

    python benchmarks/run_foundation.py                 # runs everything, one thread per run (about 10 minutes)
    python benchmarks/run_foundation.py --report-only   # rebuilds the tables from the committed CSV
    python benchmarks/report.py                         # puts the tables into benchmarks/README.md

Writes benchmarks/results/foundation.csv (one row per run and figure, with provenance),
benchmarks/results/grpo.md (one table: the SFT and GRPO rows) and benchmarks/results/grpo_curve.png (seed 0).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows, mean_std  # noqa: E402

CSV = "foundation.csv"
SEEDS = (0, 1, 2)
FIGURES = ["eval_acc_start", "eval_acc_end", "eval_acc_best", "eval_acc_hard_end", "eval_pass@8_end",
           "train_reward_first", "train_reward_last", "gen_tokens", "tokens_per_s", "wall_s"]


def run(seeds, threads: int) -> None:
    from algos import grpo, sft

    for seed in seeds:
        out = f"runs/bench_foundation/sft_s{seed}"
        s = sft.main(sft.Args(seed=seed, out_dir=out, threads=threads))
        append_rows(CSV, "foundation", "algos/sft.py", "default", seed, s,
                    f"python algos/sft.py --seed {seed} --threads {threads}")
        out = f"runs/bench_foundation/grpo_s{seed}"
        s = grpo.main(grpo.Args(seed=seed, out_dir=out, threads=threads))
        append_rows(CSV, "foundation", "algos/grpo.py", "default", seed, s,
                    f"python algos/grpo.py --seed {seed} --threads {threads}")
        if seed == 0:
            shutil.copy(Path(out) / "grpo" / "curve.png", RESULTS / "grpo_curve.png")


def fmt(vals, pct=True):
    return mean_std(vals, 100 if pct else 1, 1 if pct else 0, bare_single=False)


def report() -> None:
    rows = read_rows(CSV)
    per_seed = defaultdict(lambda: defaultdict(dict))  # script -> metric -> seed -> value (a later row wins)
    meta = {}
    for r in rows:
        per_seed[r["script"]][r["metric"]][r["seed"]] = float(r["value"])
        meta[r["script"]] = r
    by = {script: {k: list(v.values()) for k, v in metrics.items()} for script, metrics in per_seed.items()}
    lines = ["| script | held-out acc start | end | best | harder (3-digit) end | pass@8 end | gain (points) | "
             "wall s | gen tokens/s | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for script in ("algos/sft.py", "algos/grpo.py"):
        f = by.get(script)
        if not f:
            continue
        gains = [e - s for s, e in zip(f["eval_acc_start"], f["eval_acc_end"])]
        lines.append(f"| `{script}` | {fmt(f['eval_acc_start'])} | {fmt(f['eval_acc_end'])} | "
                     f"{fmt(f['eval_acc_best'])} | {fmt(f.get('eval_acc_hard_end', []))} | "
                     f"{fmt(f.get('eval_pass@8_end', []))} | {fmt(gains)} | {fmt(f['wall_s'], False)} | "
                     f"{fmt(f.get('tokens_per_s', []), False)} | {len(f['eval_acc_end'])} |")
    any_row = next(iter(meta.values()), None)
    if any_row:
        lines.append("")
        lines.append(f"Task: 2-digit addition (`add`), greedy decoding on held-out prompts (500 for GRPO, the first 300 of them for SFT); start = the shipped "
                     f"`tiny-0.6m`. Mean ± std over seeds; hardware: {any_row['hardware']}; "
                     f"{any_row['versions']}; commit {any_row['commit']}. Rows: `benchmarks/results/{CSV}`; "
                     f"command: `python benchmarks/run_foundation.py`.")
    (RESULTS / "grpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.threads)
    report()
