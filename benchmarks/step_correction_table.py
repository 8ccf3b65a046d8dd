"""Step correction (SCOPE, R^3L) against GRPO: salvaged rollouts, generated tokens per success, held-out accuracy.

    python benchmarks/step_correction_table.py                  # 3 arms x 3 seeds (about 25 minutes on 2 cores)
    python benchmarks/step_correction_table.py --arms SCOPE --seeds 0   # some runs
    python benchmarks/step_correction_table.py --report-only    # rebuilds the table from the CSV
    python benchmarks/step_correction_table.py --plan --seeds 10 11 12 13 14 15   # the claims plan's fresh run

--plan: GRPO and R^3L at the fresh seeds that benchmarks/claims_plan.csv asks for, rows under the bench
`step_correction_plan`, reported in a table of their own, so that they neither pool with the first runs' seeds nor
stand in for them.

The claims: SCOPE ("Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy Guidance",
arXiv:2602.24110) locates a failed rollout's first wrong step with a process reward model, keeps the correct prefix
and rectifies the rest, which salvages largely correct rollouts and raises accuracy over GRPO. R^3L ("R^3L:
Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal Credit, and Positive
Amplification", arXiv:2601.03715) restarts from the failure point, which cuts rollout cost, and with its credit rules
improves on its baselines by 5% to 52% (relative).

Arms, all on tiny-sums and `sums` (5 one-digit operands, running totals, ~33-token answers), 32 prompts x 8
completions per rollout batch, STEPS batches, lr 1e-4, held-out greedy accuracy on 300 prompts every EVAL_EVERY
batches:
  GRPO     algos/grpo.py (the control: the same rollouts, no correction)
  SCOPE    algos/step_correction.py --mode scope: up to 2 failures per group corrected from their first wrong step,
           the step written by the checker (importance-weighted), the rest by the policy
  R^3L     algos/step_correction.py --mode r3l: up to 2 failures per group retried by the policy from their first
           wrong step, the shared prefix masked in both, successes' advantages x 2
The correction arms generate and train on more sequences per batch than GRPO (their corrections): accuracy is
compared at an equal number of rollout batches, and the cost side is the tokens-per-success row.

The plan, fixed before the runs (its lines are in benchmarks/claims_plan.csv):
- "tokens per success" = all generated tokens (rollouts + every correction's guided and regenerated tokens) divided
  by the successful trajectories (rollouts and corrections that the verifier accepts), over the run. R^3L < GRPO,
  effect 10% of the larger mean (the abstract gives no cost figure; a restart saves the prefix of each retried
  failure, about a third of a response here, on a fifth to a quarter of the batch).
- held-out accuracy at the end: SCOPE > GRPO (effect 2.6 points: the abstract gives no gain over GRPO, the median of
  the gains this table's accuracy claims quote) and R^3L > GRPO (effect 5% of the larger mean, the low end of the
  abstract's 5% to 52% relative improvements).
- the share of corrections that succeed (salvage rate): described, not compared (GRPO salvages nothing by
  construction).
- 3 seeds per arm (what 2 shared cores allow here); GRPO's seed spread on sums is a few points, so the accuracy rows
  can only detect differences of several points and are expected to be underpowered.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): SCOPE > GRPO in held-out accuracy is a paired
t test on the per-seed differences of `--arms GRPO SCOPE --seeds 20 21 22`.

Writes benchmarks/results/step_correction.csv (one row per run and metric; the eval curve as acc_s<step>) and
step_correction.md.
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

CSV, NAME = "step_correction.csv", "step_correction"
SEEDS = (0, 1, 2)
# the claims plan's later fresh runs (benchmarks/claims_plan.csv), whose rows went under the main bench
PLAN_RUNS = ((20, 22), (100, 109))
STEPS, EVAL_EVERY, PROMPTS, G = 40, 10, 32, 8
COMMON = dict(model="tiny-sums", task="sums", digits=1, max_new_tokens=48, steps=STEPS, eval_every=EVAL_EVERY,
              eval_examples=300, pass_k=0, eval_hard=False, threads=1, prompts_per_step=PROMPTS, group_size=G)
FLAGS = (f"--model tiny-sums --task sums --digits 1 --max-new-tokens 48 --steps {STEPS} --eval-every {EVAL_EVERY} "
         f"--eval-examples 300 --pass-k 0 --no-eval-hard --threads 1 --prompts-per-step {PROMPTS} --group-size {G}")
ARMS = {"GRPO": ("grpo", {}, ""), "SCOPE": ("step_correction", {"mode": "scope"}, " --mode scope"),
        "R^3L": ("step_correction", {"mode": "r3l"}, " --mode r3l")}


def run_figures(run_dir: Path, summary: dict) -> dict:
    """The run's eval curve (acc_s<step>) and, for every arm alike, successes and tokens per success from its logged
    batches: the rollouts' successes (rollout/reward x batch, the reward being the 0/1 verifier) plus the corrections'
    (correction/salvaged), over the summary's gen_tokens (rollouts + corrections)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if "rollout/reward" in r]
    successes = sum(round(r["rollout/reward"] * PROMPTS * G) + r.get("correction/salvaged", 0) for r in train)
    out = {f"acc_s{r['step']}": r["eval/acc"] for r in rows if "eval/acc" in r}
    out.update(successes=successes, tokens_per_success=summary["gen_tokens"] / max(1, successes),
               corrected_per_batch=sum(r.get("correction/corrected", 0) for r in train) / len(train))
    return out


PLAN, PLAN_ARMS = "step_correction_plan", ("GRPO", "R^3L")  # --plan: its bench and arms


def run(seeds, arms, bench: str = NAME) -> None:
    import importlib

    for seed in seeds:
        for label in arms:
            script, extra, flag = ARMS[label]
            mod = importlib.import_module(f"algos.{script}")
            out, exp = f"runs/bench_{bench}/s{seed}", label.replace("^", "")
            s = mod.main(mod.Args(seed=seed, out_dir=out, exp_name=exp, **COMMON, **extra))
            s.update(run_figures(Path(out) / exp, s))
            append_rows(CSV, bench, f"algos/{script}.py", label, seed, s,
                        f"python algos/{script}.py {FLAGS} --seed {seed}{flag}")


def report() -> None:
    by, meta = by_config_seed(CSV, NAME)
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["| arm | held-out acc start | end | best | generated tokens | successes | tokens per success | "
             "corrections per batch | salvage rate | salvaged share of successes | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('gen_tokens'), 1, 0)} | "
                     f"{mean_std(get('successes'), 1, 0)} | {mean_std(get('tokens_per_success'), 1, 1)} | "
                     f"{mean_std(get('corrected_per_batch'), 1, 1)} | {mean_std(get('salvage_rate'), 100)} | "
                     f"{mean_std(get('salvaged_share'), 100)} | {mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Held-out greedy accuracy in %, mean ± std over seeds. tiny-sums on `sums` (5 one-digit operands), "
              f"{STEPS} rollout batches of {PROMPTS} prompts x {G} completions per arm, lr 1e-4, 300 held-out prompts "
              f"every {EVAL_EVERY} batches. Generated tokens: every sampled token of the rollouts plus, for the "
              f"correction arms, each correction's checker-written step (SCOPE) and regenerated continuation (the kept "
              f"prefix is not regenerated and not counted). Successes: rollouts and corrections the verifier accepts, "
              f"over the run; tokens per success = generated tokens / successes. Salvage rate: the share of "
              f"corrections that succeed; salvaged share: the share of all successes that are salvaged corrections. "
              f"The correction arms train on G + corrections rows per prompt (up to 2 corrections per group). "
              f"Hardware: {row['hardware']} (shared); {row['versions']}; commit {row['commit']}. Rows: "
              f"`benchmarks/results/{CSV}`; command: `python benchmarks/step_correction_table.py`."]
    fresh = by_config_seed(CSV, PLAN)[0]
    if fresh:
        lines += ["", "The claims plan's fresh run (`--plan`: its own seeds, GRPO and R^3L only):", "",
                  "| arm | held-out acc end | tokens per success | seeds |", "|---|---|---|---|"]
        for label in PLAN_ARMS:
            runs = fresh.get(label, {})
            get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
            if runs:
                lines.append(f"| {label} | {mean_std(get('eval_acc_end'), 100)} | "
                             f"{mean_std(get('tokens_per_success'), 1, 1)} | {', '.join(sorted(runs, key=int))} |")
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("tokens per success", "tokens_per_success", 1, 1),
            ("salvage rate", "salvage_rate", 100, 1)]
    lines += fresh_run_tables(parts[1:], cols, ARMS)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--plan", action="store_true",
                    help="the claims plan's fresh run: GRPO and R^3L at --seeds, under the bench step_correction_plan")
    a = ap.parse_args()
    if a.plan:
        run(a.seeds, PLAN_ARMS, PLAN)
    elif not a.report_only:
        run(a.seeds, a.arms)
    report()
