"""Online rollout pruning (ARRoL) against GRPO at equal final group size: generated tokens, groups with a learning
signal, group reward spread, held-out accuracy.

    python benchmarks/rollout_pruning_table.py                  # 3 arms x 3 seeds (about 12 minutes on 2 cores)
    python benchmarks/rollout_pruning_table.py --arms ARRoL --seeds 0   # some runs
    python benchmarks/rollout_pruning_table.py --report-only    # rebuilds the table from the CSV

The claims ("Prune as You Generate: Online Rollout Pruning for Faster and Better RLVR", arXiv:2603.24840): a quality
head trained on the fly predicts the success of partial rollouts, and pruning them early so that the survivors are
more correctness-balanced strengthens the learning signal (fewer groups whose rewards are all equal) and raises
average accuracy by +2.30 to +2.99 points over GRPO and DAPO, with up to 1.7x training speed-up.

Arms, all algos/rollout_pruning.py at its defaults (tiny-0.6m on 2-digit addition, 100 rollout batches of 32 prompts,
a final group of G = 8 per prompt, lr 1e-4, held-out greedy accuracy on 500 prompts every 25 batches):
  GRPO          --oversample 1: G = 8 full rollouts per prompt, no head (tested identical to algos/grpo.py)
  ARRoL         G' = 16 partial rollouts of t = 1 token, the head's floor(G/2) lowest and ceil(G/2) highest
                predicted successes kept and finished
  ARRoL-random  the same over-sampling and pruning point, G survivors drawn at random (the control that isolates
                the head: the same token cost, no prediction)
Every arm trains on G = 8 rollouts per prompt; the pruning arms also generate the pruned prefixes, which count.

The plan, fixed before the runs (its lines are in benchmarks/claims_plan.csv):
- the share of groups with a non-zero advantage (not all rewards equal), averaged over the run's rollout batches:
  ARRoL > GRPO, effect 5 points (the abstract gives no figure; 5 points of groups is the least that a method built
  to create learning signal should deliver).
- held-out accuracy at the end: ARRoL > GRPO, effect 2.3 points (the low end of the abstract's +2.30 to +2.99).
- generated tokens per run (all arms' tokens, pruned prefixes included): described, not compared (the extra tokens
  of over-sampling are fixed by G', t and the response length; the paper's 1.7x speed-up is in wall-clock time
  inside an inference engine, which a 2-core CPU does not measure).
- 3 seeds per arm (what 2 shared cores allow here).

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): the accuracy row, ARRoL > GRPO, is a paired t
test on the per-seed differences of `--arms ARRoL GRPO --seeds 20 21 22 23 24 25`.

Writes benchmarks/results/rollout_pruning.csv (one row per run and metric; the eval curve as acc_s<step>) and
rollout_pruning.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 split_runs)

CSV, NAME = "rollout_pruning.csv", "rollout_pruning"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((20, 25), (100, 122))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
STEPS, EVAL_EVERY = 100, 25
COMMON = dict(steps=STEPS, eval_every=EVAL_EVERY, eval_examples=500, pass_k=0, eval_hard=False, threads=1)
FLAGS = f"--steps {STEPS} --eval-every {EVAL_EVERY} --eval-examples 500 --pass-k 0 --no-eval-hard --threads 1"
ARMS = {"GRPO": ({"oversample": 1}, " --oversample 1"), "ARRoL": ({}, ""),
        "ARRoL-random": ({"prune_rule": "random"}, " --prune-rule random")}


def run_figures(run_dir: Path) -> dict:
    """The run's eval curve (acc_s<step>) and the generated tokens per rollout batch."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {f"acc_s{r['step']}": r["eval/acc"] for r in rows if "eval/acc" in r}


def run(seeds, arms) -> None:
    from algos import rollout_pruning as rp

    for seed in seeds:
        for label in arms:
            extra, flag = ARMS[label]
            out, exp = f"runs/bench_rollout_pruning/s{seed}", label
            s = rp.main(rp.Args(seed=seed, out_dir=out, exp_name=exp, **COMMON, **extra))
            s.update(run_figures(Path(out) / exp), tokens_per_batch=s["gen_tokens"] / STEPS)
            append_rows(CSV, NAME, "algos/rollout_pruning.py", label, seed, s,
                        f"python algos/rollout_pruning.py {FLAGS} --seed {seed}{flag}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["| arm | held-out acc start | end | best | generated tokens | of which pruned | groups with a non-zero "
             "advantage | group reward std | head AUC | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r and r[k] == r[k]]  # noqa: E731 (nan: no head)
        auc = mean_std(get("head_auc"), 1, 3) if get("head_auc") else "-"
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('gen_tokens'), 1, 0)} | "
                     f"{mean_std(get('pruned_tokens'), 1, 0)} | {mean_std(get('nonzero_adv_group_frac'), 100)} | "
                     f"{mean_std(get('group_reward_std'), 1, 3)} | {auc} | {mean_std(get('wall_s'), 1, 0)} | "
                     f"{len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Held-out greedy accuracy and groups with a non-zero advantage in %, mean ± std over seeds. "
              f"tiny-0.6m on 2-digit addition, {STEPS} rollout batches of 32 prompts, a final group of G = 8 per prompt "
              f"in every arm (the pruning arms sample G' = 16 partial rollouts of t = 1 token and keep 8), lr 1e-4, "
              f"500 held-out prompts every {EVAL_EVERY} batches. Generated tokens: every sampled token over the run, the "
              f"pruned prefixes included (their share in the next column). Groups with a non-zero advantage: the share "
              f"of a batch's groups whose G rewards are not all equal, averaged over batches; group reward std: the "
              f"mean within-group std of the 0/1 rewards. Head AUC: how well the head ranks the survivors of a batch it "
              f"has not yet trained on (0.5 = chance). Hardware: {row['hardware']} (shared); {row['versions']}; commit "
              f"{row['commit']}. Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/rollout_pruning_table.py`."]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("generated tokens", "gen_tokens", 1, 0),
            ("groups with a non-zero advantage", "nonzero_adv_group_frac", 100, 1), ("wall s", "wall_s", 1, 0)]
    lines += fresh_run_tables(parts[1:], cols, ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
