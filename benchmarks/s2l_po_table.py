"""S2L-PO: held-out accuracy against rollout compute when a fixed smaller model generates the early rollouts, with
and without annealing to the learner's own samples, against GRPO on the learner's own samples.

    python benchmarks/s2l_po_table.py                   # 3 arms x 3 seeds (about 10 minutes on one thread)
    python benchmarks/s2l_po_table.py --arms GRPO --seeds 0   # some runs
    python benchmarks/s2l_po_table.py --report-only     # rebuilds the table and the plot from the CSV

The claim (Ren, Xu, Lin et al., "Smaller Models are Natural Explorers for Policy-Level Diversity in GRPO",
arXiv:2605.30789): a fixed smaller model of the same family explores for the larger learner, and a progressive
annealing from its rollouts to the learner's own gives higher accuracy than GRPO (+8.8% on AIME 24 with a 1.7B
explorer for an 8B learner) while reducing rollout compute; the annealing avoids the mid-training drop that the small
model's capacity would cause.

Arms, all algos/s2l_po.py at its defaults (learner tiny-5m, explorer tiny-0.6m, 2-digit `add`, 32 prompts x 8
completions per rollout batch, lr 3e-5, STEPS batches), held-out greedy accuracy on 300 prompts every EVAL_EVERY
batches; the arms differ in who samples only:
  S2L-PO                    --explorer-frac 1 --anneal-steps 20: the explorer's share of each group falls linearly
                            from all to none over the first 20 batches, then the learner samples alone
  S2L-PO, no annealing      --anneal-steps 0: the explorer samples every group for the whole run
  GRPO                      --explorer-frac 0: the learner samples every group (grpo.py exactly)
Rollout compute counts 2 x parameters x generated tokens of whichever model generated them (tiny-0.6m: 652,544
parameters; tiny-5m: 5,140,480).

The plan, fixed before these runs (its lines are in benchmarks/claims_plan.csv):
- "higher accuracy than GRPO": `eval_acc_end`, direction S2L-PO > GRPO, effect 8.8 points (the abstract's AIME 24
  gain).
- "with less rollout compute": `acc_at_budget`, held-out accuracy at a rollout budget of BUDGET FLOPs (linear
  between the evaluations around it on the accuracy-against-compute curve; every arm passes it: GRPO after about 3
  batches, the explorer alone after about 26), direction S2L-PO > GRPO, effect 2.6 points (no figure in the
  abstract: the median gain this table's accuracy claims quote from their papers).
- "annealing avoids the small model's ceiling": `eval_acc_end`, direction S2L-PO > S2L-PO, no annealing, effect
  2.6 points (no figure in the abstract, as above).
- 3 seeds per arm, the budget here; a one-seed pilot of the same arms (30 batches, evaluations every 10) gave no
  spreads, so the rows say after the run how many seeds 80% power needs.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): the equal-compute row, S2L-PO > GRPO in
accuracy at the FLOPs budget, is a paired t test on the per-seed differences of
`--arms S2L-PO GRPO --seeds 20 21 22 23 24 25 26 27 28 29`.

Writes benchmarks/results/s2l_po.csv (one row per run and metric; the curves as acc_s<step> and flops_s<step>),
s2l_po.md and s2l_po.png (accuracy against rollout FLOPs).
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

CSV, NAME = "s2l_po.csv", "s2l_po"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((20, 29), (100, 108), (300, 309))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
STEPS, EVAL_EVERY, BUDGET = 40, 2, 3e10
COMMON = dict(steps=STEPS, eval_every=EVAL_EVERY, eval_examples=300, pass_k=0, eval_hard=False, threads=1)
FLAGS = f"--steps {STEPS} --eval-every {EVAL_EVERY} --eval-examples 300 --pass-k 0 --no-eval-hard --threads 1"
ARMS = {"S2L-PO": (dict(explorer_frac=1.0, anneal_steps=20), " --explorer-frac 1 --anneal-steps 20"),
        "S2L-PO, no annealing": (dict(explorer_frac=1.0, anneal_steps=0), " --explorer-frac 1 --anneal-steps 0"),
        "GRPO": (dict(explorer_frac=0.0), " --explorer-frac 0")}


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """[(step, cumulative rollout FLOPs, held-out accuracy)] of one run, from its metrics.jsonl (step 0: 0 FLOPs)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [(r["step"], r.get("s2l/rollout_flops", 0.0), r["eval/acc"]) for r in rows if "eval/acc" in r]


def at_budget(points: list[tuple[int, float, float]], budget: float) -> float:
    """Accuracy at `budget` FLOPs, linear between the two evaluations around it (nan when the run stops short)."""
    for (_, f0, a0), (_, f1, a1) in zip(points, points[1:]):
        if f0 <= budget <= f1:
            return a0 + (a1 - a0) * (budget - f0) / (f1 - f0) if f1 > f0 else a1
    return float("nan")


def run(seeds, arms) -> None:
    from algos import s2l_po

    for seed in seeds:
        for label in arms:
            fields, flag = ARMS[label]
            out, exp = f"runs/bench_s2l_po/s{seed}", label.replace(", ", "_").replace(" ", "_")
            s = s2l_po.main(s2l_po.Args(seed=seed, out_dir=out, exp_name=exp, **fields, **COMMON))
            pts = curve(Path(out) / exp)
            s.update({f"acc_s{x}": a for x, _, a in pts})
            s.update({f"flops_s{x}": f for x, f, _ in pts})
            s["acc_at_budget"] = at_budget(pts, BUDGET)
            rows = [json.loads(line) for line in open(Path(out) / exp / "metrics.jsonl")]
            s["reward_last10"] = statistics.mean([r["rollout/reward"] for r in rows if "rollout/reward" in r][-10:])
            append_rows(CSV, NAME, "algos/s2l_po.py", label, seed, s,
                        f"python algos/s2l_po.py {FLAGS} --seed {seed}{flag}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = [f"| arm | held-out acc start | end | best | acc at {BUDGET:.0e} rollout FLOPs | rollout FLOPs, "
             f"{STEPS} batches | mean reward, last 10 batches | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('acc_at_budget'), 100)} | "
                     f"{mean_std(get('rollout_flops'), 1e-9, 1)} G | {mean_std(get('reward_last10'), 100)} | "
                     f"{mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Figures in %, mean ± std over seeds. Learner tiny-5m, explorer tiny-0.6m, 2-digit `add`, "
              f"{STEPS} rollout batches of 32 prompts x 8 completions, lr 3e-5; held-out greedy accuracy on 300 "
              f"prompts every {EVAL_EVERY} batches. S2L-PO: the explorer's share of each group falls linearly from "
              f"all to none over the first 20 batches; no annealing: the explorer samples every group; GRPO: the "
              f"learner samples every group. The explorer's tokens are weighted by min(pi_old / pi_explorer, 2). "
              f"Rollout compute: 2 x parameters x generated tokens of the model that generated them (G = 1e9); "
              f"accuracy at {BUDGET:.0e} FLOPs is linear between the evaluations around that budget. Mean reward is "
              f"the sampled completions' (whoever sampled them). Hardware: {row['hardware']} (shared); "
              f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/s2l_po_table.py`.", "",
              "![S2L-PO: held-out accuracy against rollout FLOPs](results/s2l_po.png)"]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("acc at the FLOP budget", "acc_at_budget", 100, 1)]
    lines += fresh_run_tables(parts[1:], cols, ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    for label in ARMS:
        runs = list(by.get(label, {}).values())
        if not runs:
            continue
        steps = sorted(set.intersection(*({int(k[5:]) for k in r if k.startswith("acc_s")} for r in runs)))
        xs = [statistics.mean(r[f"flops_s{s}"] for r in runs) / 1e9 for s in steps]
        ys = [100 * statistics.mean(r[f"acc_s{s}"] for r in runs) for s in steps]
        keep = [i for i, x in enumerate(xs) if x > 0]  # a log axis: the start (0 FLOPs) is the dashed line
        ax.plot([xs[i] for i in keep], [ys[i] for i in keep], "o-", ms=2.5, label=f"{label} ({len(runs)} seeds)")
        start = ys[0]
    ax.axhline(start, color="grey", lw=0.8, ls="--")
    ax.axvline(BUDGET / 1e9, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="rollout compute, GFLOPs (2 x params x generated tokens)",
           ylabel="held-out greedy accuracy, %", title="tiny-0.6m explores for tiny-5m, mean of seeds")
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
