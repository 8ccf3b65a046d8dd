"""SFPO against GRPO at equal rollouts: how fast held-out accuracy rises per sampled sequence, and where it ends.

    python benchmarks/sfpo_table.py                     # 3 arms x 3 seeds (about 15 minutes on 2 cores), table, plot
    python benchmarks/sfpo_table.py --arms SFPO --seeds 0   # some runs
    python benchmarks/sfpo_table.py --report-only       # rebuilds the table and the plot from the CSV

The claim ("Slow-Fast Policy Optimization: Reposition-Before-Update for LLM Reasoning", arXiv:2510.04072): with the
same rollouts and objective, a fast trajectory of K inner steps on each batch, a reposition back towards the start
and a slow correction reach GRPO's best accuracy with up to 4.93x fewer rollouts, and end up to 2.80 points higher.

Arms, all on tiny-0.6m and 2-digit `add`, 32 prompts x 8 completions per rollout batch, STEPS batches (the same
rollout count for every arm), lr 1e-4, held-out greedy accuracy on 300 prompts every EVAL_EVERY batches:
  GRPO                  algos/grpo.py (one optimiser step per batch)
  SFPO                  algos/sfpo.py: K = 3, alpha = 0.8, the entropy switch (window 30, z >= 1) as released
  SFPO, alpha = 1       the control for the reposition: the same K + 1 passes per batch and the same switch, no pull
                        back (before the switch that is grpo.py --ppo-epochs 4). SFPO against GRPO changes both the
                        number of gradient passes and the reposition; this arm separates the two.

The plan, fixed before the runs (the claims table's plan-first rule; its lines are in benchmarks/claims_plan.csv, the
effect to detect 2.8 points, the paper's average gain):
- Row 1, "fewer rollouts to GRPO's best accuracy": a time-to-target is an area under the curve here. Metric: the
  area under held-out accuracy against cumulative rollouts, over the whole budget, divided by the budget (the mean
  accuracy over the run, trapezoids between evaluations, start included), `acc_auc`. Direction SFPO > GRPO. The
  censored rollouts-to-target (target: the mean over GRPO's seeds of its best accuracy; a run that never reaches it
  counts the whole budget and is flagged) is reported beside it, not decided.
- Row 2, "accuracy at equal rollouts": `eval_acc_end`, direction SFPO > GRPO.
- 3 seeds per arm. Power: GRPO's seed std on this setting is 1.3 to 5.4 points (grpo_family.csv, foundation.csv);
  with 3 against 3 seeds Welch's test has 80% power only for differences of about 9 points (at std 3), so row 2 is
  underpowered for the paper's 2.80 points (about 18 seeds per arm would decide it). Row 1 is decisive for a
  speed-up of the paper's size (an AUC gap of several points when the curve reaches GRPO's best in a fraction of
  the budget); a smaller one stays inconclusive.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): the area-under-the-curve row, SFPO > GRPO, is a
paired t test on the per-seed differences of `--arms GRPO SFPO --seeds 20 21 22 23 24 25 26 27`.

Writes benchmarks/results/sfpo.csv (one row per run and metric; the eval curve as acc_r<rollouts>), sfpo.md and
sfpo.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 split_runs)

CSV, NAME = "sfpo.csv", "sfpo"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((20, 27), (100, 108), (300, 354))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
STEPS, EVAL_EVERY, PROMPTS, G = 60, 10, 32, 8
COMMON = dict(steps=STEPS, eval_every=EVAL_EVERY, eval_examples=300, pass_k=0, eval_hard=False, threads=1,
              prompts_per_step=PROMPTS, group_size=G)
FLAGS = (f"--steps {STEPS} --eval-every {EVAL_EVERY} --eval-examples 300 --pass-k 0 --no-eval-hard --threads 1 "
         f"--prompts-per-step {PROMPTS} --group-size {G}")
ARMS = {"GRPO": ("grpo", {}, ""), "SFPO": ("sfpo", {}, ""),
        "SFPO, alpha = 1": ("sfpo", {"alpha": 1.0}, " --alpha 1.0")}


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """[(cumulative rollouts, held-out accuracy)] of one run, from its metrics.jsonl (step 0 = the start)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [(r["step"] * PROMPTS * G, r["eval/acc"]) for r in rows if "eval/acc" in r]


def auc(points: list[tuple[int, float]]) -> float:
    """Area under accuracy against rollouts (trapezoids) divided by the span: the run's mean accuracy."""
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def run(seeds, arms) -> None:
    import importlib

    for seed in seeds:
        for label in arms:
            script, extra, flag = ARMS[label]
            mod = importlib.import_module(f"algos.{script}")
            out = f"runs/bench_sfpo/s{seed}"
            exp = label.replace(" ", "").replace(",", "_").replace("=", "")
            s = mod.main(mod.Args(seed=seed, out_dir=out, exp_name=exp, **COMMON, **extra))
            pts = curve(Path(out) / exp)
            s.update(acc_auc=auc(pts), **{f"acc_r{x}": y for x, y in pts})
            append_rows(CSV, NAME, f"algos/{script}.py", label, seed, s,
                        f"python algos/{script}.py {FLAGS} --seed {seed}{flag}")


def rollouts_to(points: dict, target: float) -> tuple[int, bool]:
    """Rollouts at the first evaluation with accuracy >= target (the budget if none: censored)."""
    xs = sorted(points)
    hit = next((x for x in xs if points[x] >= target - 1e-9), None)
    return (xs[-1], False) if hit is None else (hit, True)


def report() -> None:
    by, meta = by_config_seed(CSV)
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    pts = {label: {seed: {int(k[5:]): v for k, v in r.items() if k.startswith("acc_r")} for seed, r in runs.items()}
           for label, runs in by.items()}
    grpo_best = [r["eval_acc_best"] for r in by.get("GRPO", {}).values()]
    target = statistics.mean(grpo_best) if grpo_best else float("nan")
    lines = ["| arm | held-out acc start | end | best | mean acc over the run (AUC) | rollouts to GRPO's best | "
             "reached | stop step of the switch | wall s | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        costs = [rollouts_to(p, target) for p in pts[label].values()]
        stops = get("sfpo_stop_step")
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('acc_auc'), 100)} | "
                     f"{mean_std([c for c, _ in costs], 1, 0)} | {sum(r for _, r in costs)}/{len(costs)} | "
                     f"{', '.join(str(int(s)) if s else 'never' for s in stops) if stops else '-'} | "
                     f"{mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    row = next(iter(meta.values()))
    budget = STEPS * PROMPTS * G
    lines += ["", f"Held-out greedy accuracy in %, mean ± std over seeds. tiny-0.6m on 2-digit `add`, {STEPS} rollout "
              f"batches of {PROMPTS} prompts x {G} completions for every arm ({budget:,} sampled sequences), lr 1e-4, "
              f"300 held-out prompts every {EVAL_EVERY} batches. AUC: the area under accuracy against rollouts over "
              f"the budget divided by it (the run's mean accuracy, start included). Rollouts to GRPO's best: the "
              f"first evaluation at or above the mean over GRPO's seeds of its best accuracy ({100 * target:.1f}%); a "
              f"run that never gets there counts the whole budget (a lower bound, see `reached`). SFPO: K = 3 fast "
              f"passes, alpha = 0.8, switched to plain GRPO steps once the entropy z-score over 30 batches reaches 1 "
              f"(the step is listed per seed). 'SFPO, alpha = 1': the same passes without the pull back (the control "
              f"for the reposition). SFPO trains K + 1 = 4 passes per batch, so its train seconds are about 4x; the "
              f"claim counts rollouts. Hardware: {row['hardware']} (shared); {row['versions']}; commit "
              f"{row['commit']}. Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/sfpo_table.py`.",
              "", "![SFPO and GRPO: held-out accuracy against rollouts](results/sfpo.png)"]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("mean acc over the run (AUC)", "acc_auc", 100, 1)]
    lines += fresh_run_tables(parts[1:], cols, ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(pts)


def plot(pts: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label in ARMS:
        runs = list(pts.get(label, {}).values())
        if not runs:
            continue
        xs = sorted(set.intersection(*(set(r) for r in runs)))
        ax.plot(xs, [100 * statistics.mean(r[x] for r in runs) for x in xs], "o-", ms=3, label=f"{label} ({len(runs)})")
    ax.set(xlabel="sampled sequences (rollouts)", ylabel="held-out greedy accuracy, %",
           title="SFPO vs GRPO, mean of seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table and the plot from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
