"""POISE against GRPO per generated token, and uniqueness-weighted GRPO against GRPO on pass@k and strategies.

    python benchmarks/poise_unique_table.py                  # both comparisons, 3 seeds (minutes on 2 cores)
    python benchmarks/poise_unique_table.py --only poise     # one of them
    python benchmarks/poise_unique_table.py --report-only    # rebuilds the tables from the CSV

POISE ("Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation from Actor's Internal
States", arXiv:2605.07579; the abstract: matches DAPO "while requiring less compute"): `add` (2-digit addition),
tiny-0.6m, the same rollout batches for every arm, three arms:
  GRPO, G = 8 x 32 prompts          algos/grpo.py (256 rollouts per batch)
  POISE, 2 x 128 prompts            algos/poise.py (256 rollouts per batch: the same tokens, 4x the prompts)
  POISE, 2 x 32 prompts             algos/poise.py (64 rollouts per batch: a quarter of the tokens)
Figures: held-out greedy accuracy after the batches, generated tokens, and the accuracy gain per million
generated tokens.

Uniqueness weighting ("Rewarding the Rare: Uniqueness-Aware RL for Creative Problem Solving in LLMs",
arXiv:2601.08763; the abstract: better pass@k and AUC@K "without sacrificing pass@1", more distinct strategies):
the reach task with tiny-reach (algos/unique_grpo.py), G = 8 x 32 prompts, alpha = 1 against alpha = 0 (plain
GRPO, same script and flags). Figures on 200 held-out prompts with 16 samples each: pass@1 (sampled), pass@16,
AUC@16 (the mean of pass@1..16) and the number of distinct operator multisets among the correct samples.

Paired re-plan (benchmarks/claims_plan.csv; seeds 10-17 are its pilot): the uniqueness row is a paired t test on the
per-seed differences of `--only unique --seeds 20 21 22 23 24 25`.

Writes benchmarks/results/poise_unique.csv and poise_unique.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 split_runs)

CSV, NAME = "poise_unique.csv", "poise_unique"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((10, 19), (20, 25))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
POISE_STEPS, UNIQUE_STEPS = 40, 40
COMMON = dict(eval_examples=300, pass_k=0, eval_hard=False, threads=1)
POISE_ARMS = {"GRPO, G=8 x 32 prompts": ("grpo", dict(group_size=8, prompts_per_step=32)),
              "POISE, 2 x 128 prompts": ("poise", dict(group_size=2, prompts_per_step=128)),
              "POISE, 2 x 32 prompts": ("poise", dict(group_size=2, prompts_per_step=32))}
UNIQUE_ARMS = {"GRPO (alpha=0)": 0.0, "uniqueness-weighted (alpha=1)": 1.0}


def flags(d: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else
                    f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in d.items())


def run_poise(seeds) -> None:
    from algos import grpo, poise

    for seed in seeds:
        for label, (script, arm) in POISE_ARMS.items():
            mod = grpo if script == "grpo" else poise
            kw = dict(steps=POISE_STEPS, eval_every=POISE_STEPS // 2, **COMMON, **arm)
            s = mod.main(mod.Args(seed=seed, out_dir=f"runs/bench_poise/s{seed}", exp_name=script + str(arm["prompts_per_step"]),
                                  **kw))
            s["acc_gain_per_mtok"] = (s["eval_acc_end"] - s["eval_acc_start"]) / (s["gen_tokens"] / 1e6)
            append_rows(CSV, "poise", f"algos/{script}.py", label, seed, s,
                        f"python algos/{script}.py {flags(kw)} --seed {seed}")


def run_unique(seeds) -> None:
    from algos import unique_grpo

    for seed in seeds:
        for label, power in UNIQUE_ARMS.items():
            kw = dict(steps=UNIQUE_STEPS, eval_every=UNIQUE_STEPS, uniqueness_power=power, **COMMON)
            s = unique_grpo.main(unique_grpo.Args(seed=seed, out_dir=f"runs/bench_unique/s{seed}",
                                                  exp_name=f"alpha{power:g}", **kw))
            append_rows(CSV, "unique", "algos/unique_grpo.py", label, seed, s,
                        f"python algos/unique_grpo.py {flags(kw)} --seed {seed}")


def collect(bench: str):
    return by_config_seed(CSV, bench)


def col(runs, key, scale=100.0, digits=1):
    return mean_std([r[key] for r in runs if key in r], scale, digits)


UNIQUE_ARMS_CMP = ("uniqueness-weighted (alpha=1)", "GRPO (alpha=0)")  # the paper's arm, its control


def compare(by, a: str, b: str, key: str, scale: float = 100.0, digits: int = 1) -> str:
    """`a` minus `b` on the seed values of `key` (times `scale`): the difference, its Welch 95% interval and where the
    interval lies (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    import statistics

    from benchmarks.report import describe_comparison

    stats = []
    for label in (a, b):
        vals = [r[key] * scale for r in by[label].values() if key in r]
        stats.append((statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals)))
    return describe_comparison("0>1", stats, digits)


def report() -> None:
    lines = []
    by, meta = collect("poise")
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if by:
        lines += ["| arm | rollouts per batch | held-out acc start | end | generated tokens | gain per 1M tokens "
                  "(points) | probe R^2 | wall s | seeds |", "|---|---|---|---|---|---|---|---|---|"]
        for label, (_, arm) in POISE_ARMS.items():
            runs = list(by.get(label, {}).values())
            if runs:
                lines.append(f"| {label} | {arm['group_size'] * arm['prompts_per_step']} | "
                             f"{col(runs, 'eval_acc_start')} | {col(runs, 'eval_acc_end')} | "
                             f"{col(runs, 'gen_tokens', 1, 0)} | {col(runs, 'acc_gain_per_mtok')} | "
                             f"{col(runs, 'probe_r2', 1, 2) if 'probe_r2' in runs[0] else '-'} | "
                             f"{col(runs, 'wall_s', 1, 0)} | {len(runs)} |")
        row = next(iter(meta.values()))
        lines += ["", f"`add` (2-digit addition), tiny-0.6m, {POISE_STEPS} rollout batches per arm, lr 1e-4, 300 "
                  f"held-out prompts (greedy). POISE's probe R^2: out-of-sample, each batch scored by the probe fitted on "
                  f"the earlier ones, second half of the run. Hardware: {row['hardware']} (shared); {row['versions']}; "
                  f"commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                  f"`python benchmarks/poise_unique_table.py --only poise`.", "",
                  f"The paper's direction (POISE at least as accurate per generated token as GRPO), each comparison on "
                  f"this table's seeds alone (the difference of the seed means in points, its Welch 95% interval; "
                  f"the claims table gives the verdicts): at equal tokens, POISE 2 x 128 minus GRPO: "
                  f"{compare(by, 'POISE, 2 x 128 prompts', 'GRPO, G=8 x 32 prompts', 'eval_acc_end')}; at a quarter "
                  f"of the tokens, POISE 2 x 32 minus GRPO: "
                  f"{compare(by, 'POISE, 2 x 32 prompts', 'GRPO, G=8 x 32 prompts', 'eval_acc_end')}."]
        cols = [("held-out acc end", "eval_acc_end", 100, 1), ("generated tokens", "gen_tokens", 1, 0),
                ("gain per 1M tokens (points)", "acc_gain_per_mtok", 100, 1)]
        lines += fresh_run_tables(parts[1:], cols, POISE_ARMS) + [""]
    by, meta = collect("unique")
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if by:
        lines += ["| arm | greedy acc start | end | pass@1 (sampled) | pass@16 | AUC@16 | distinct correct strategies "
                  "| wall s | seeds |", "|---|---|---|---|---|---|---|---|---|"]
        for label in UNIQUE_ARMS:
            runs = list(by.get(label, {}).values())
            if runs:
                lines.append(f"| {label} | {col(runs, 'eval_acc_start')} | {col(runs, 'eval_acc_end')} | "
                             f"{col(runs, 'eval_pass@1_sampled_end')} | {col(runs, 'eval_pass@16_curve_end')} | "
                             f"{col(runs, 'eval_auc@16_end')} | {col(runs, 'eval_distinct_strategies_end', 1, 2)} | "
                             f"{col(runs, 'wall_s', 1, 0)} | {len(runs)} |")
        start = list(next(iter(by.values())).values())
        row = next(iter(meta.values()))
        lines += ["", f"The reach task (four one-digit numbers, + and -, at least two operator multisets reach each "
                  f"target), tiny-reach, G = 8 x 32 prompts, {UNIQUE_STEPS} rollout batches, lr 1e-4; before training: "
                  f"pass@1 {col(start, 'eval_pass@1_sampled_start')}, pass@16 {col(start, 'eval_pass@16_curve_start')}, "
                  f"AUC@16 {col(start, 'eval_auc@16_start')}, distinct strategies "
                  f"{col(start, 'eval_distinct_strategies_start', 1, 2)}. pass@k from 16 samples per prompt on 200 "
                  f"held-out prompts (unbiased estimator), greedy accuracy on 300. Hardware: {row['hardware']} (shared); "
                  f"commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                  f"`python benchmarks/poise_unique_table.py --only unique`.", "",
                  f"The paper's direction (higher AUC@K at equal pass@1, more strategies), uniqueness-weighted minus "
                  f"GRPO on this table's seeds alone: AUC@16 "
                  f"{compare(by, *UNIQUE_ARMS_CMP, 'eval_auc@16_end')}; distinct strategies "
                  f"{compare(by, *UNIQUE_ARMS_CMP, 'eval_distinct_strategies_end', 1, 2)}. "
                  f"Here plain GRPO does not collapse onto one strategy within 40 batches (its distinct strategies rise "
                  f"from the start), so there is little for the reweighting to correct."]
        cols = [("greedy acc end", "eval_acc_end", 100, 1), ("pass@1 (sampled)", "eval_pass@1_sampled_end", 100, 1),
                ("pass@16", "eval_pass@16_curve_end", 100, 1), ("AUC@16", "eval_auc@16_end", 100, 1),
                ("distinct correct strategies", "eval_distinct_strategies_end", 1, 2)]
        lines += fresh_run_tables(parts[1:], cols, UNIQUE_ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines).rstrip() + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables from the CSV")
    ap.add_argument("--only", choices=["poise", "unique"], default=None, help="run one of the two comparisons")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    a = ap.parse_args()
    if not a.report_only:
        if a.only in (None, "poise"):
            run_poise(a.seeds)
        if a.only in (None, "unique"):
            run_unique(a.seeds)
    report()
