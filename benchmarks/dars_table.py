"""DARS against GRPO and against a naively larger group, at an equal total of sampled rollouts: pass@k at the end.

    python benchmarks/dars_table.py                     # 3 arms x 3 seeds (about 10 minutes on 2 cores), the table
    python benchmarks/dars_table.py --arms "DARS (ET)" --seeds 0   # some runs
    python benchmarks/dars_table.py --report-only       # rebuilds the table from the CSV

The claim ("Depth-Breadth Synergy in RLVR: Unlocking LLM Reasoning Gains with Adaptive Exploration",
arXiv:2508.13755): GRPO's cumulative advantage neglects low-accuracy prompts; sampling hard prompts again (DARS)
gives consistent pass@k gains "without extra inference cost at convergence", while naively enlarging the rollout
size "only accelerates convergence and even hurts Pass@K". The abstract gives no figures.

Arms, all on tiny-0.6m and 2-digit `add`, 32 prompts per rollout batch, lr 1e-4, the same BUDGET sampled sequences:
  GRPO, G=8      algos/grpo.py, BUDGET / 256 batches
  GRPO, G=16     algos/grpo.py --group-size 16, BUDGET / 512 batches: the naively larger group (the control; about
                 DARS's rollouts per prompt, which average 1.5 to 2 G here)
  DARS (ET)      algos/dars.py (G = 8 in the first stage, equal treatment, grpo's std-normalised advantage) with
                 --rollout-budget BUDGET: it stops at the first batch that reaches the budget (at most one batch over)
After training, pass@k on 300 held-out prompts from 16 samples each at temperature 1 (the unbiased estimator
1 - C(n - c, k) / C(n, k)), k = 1, 4, 8, 16, and greedy accuracy on the same 300.

The plan, fixed before the runs (the claims table's plan-first rule; its lines are in benchmarks/claims_plan.csv):
metric pass@8 after the budget (`pass@8`), direction DARS > GRPO (G=8), and DARS > GRPO (G=16); 3 seeds per arm; the
effect to detect is 2.6 points (the abstract gives no number: the median of the gains that the accuracy claims of the
claims table quote from their papers). The abstract's "at convergence" is read as "at the end of an equal rollout
budget" (the tiny runs do not converge in a CPU budget). Power: at a seed std of 1.5 to 3 points, 3 against 3 seeds
has 80% power only for differences of about 4.5 to 9 points (Welch), so a smaller gain stays underpowered.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): the pass@8 row, DARS (ET) > GRPO at G = 8, is
a paired t test on the per-seed differences of `--arms "DARS (ET)" "GRPO, G=8" --seeds 20 21 22 23 24 25 26 27`.

Writes benchmarks/results/dars.csv (one row per run and metric) and dars.md.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 split_runs)

CSV, NAME = "dars.csv", "dars"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((20, 27), (100, 114))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
PROMPTS, BUDGET, N_SAMPLES, KS, EVAL_N = 32, 25_600, 16, (1, 4, 8, 16), 300
COMMON = dict(prompts_per_step=PROMPTS, eval_every=25, eval_examples=EVAL_N, pass_k=0, eval_hard=False, threads=1)
ARMS = {"GRPO, G=8": ("grpo", {"group_size": 8, "steps": BUDGET // (PROMPTS * 8)}),
        "GRPO, G=16": ("grpo", {"group_size": 16, "steps": BUDGET // (PROMPTS * 16)}),
        "DARS (ET)": ("dars", {"group_size": 8, "steps": BUDGET // (PROMPTS * 8), "rollout_budget": BUDGET})}


def flags(extra: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in extra.items())


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def final_pass_at_k(run_dir: Path, seed: int) -> dict:
    """pass@k (k in KS) from N_SAMPLES samples per prompt and greedy accuracy on the first EVAL_N held-out prompts, from
    the run's final checkpoint."""
    import torch

    import common
    from algos import _llm as llm

    model, tok = common.load_model(str(run_dir / "checkpoint"))
    model.eval()
    task = llm.make_task("add", 2)
    examples = common.held_out_sets(task, EVAL_N)["main"]
    torch.manual_seed(1000 + seed)
    with torch.no_grad():
        ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]), N_SAMPLES, 8, 1.0)
    hits = [task.verify(t, examples[i // N_SAMPLES].answer)[0] for i, t in enumerate(ro.texts)]
    correct = [int(sum(hits[j * N_SAMPLES:(j + 1) * N_SAMPLES])) for j in range(len(examples))]
    out = {f"pass@{k}": sum(pass_at_k(N_SAMPLES, c, k) for c in correct) / len(correct) for k in KS}
    out["unsolved_frac"] = sum(c == 0 for c in correct) / len(correct)
    return out


def run(seeds, arms) -> None:
    import importlib

    for seed in seeds:
        for label in arms:
            script, extra = ARMS[label]
            mod = importlib.import_module(f"algos.{script}")
            out, exp = f"runs/bench_dars/s{seed}", re.sub(r"\W+", "_", label).strip("_")
            s = mod.main(mod.Args(seed=seed, out_dir=out, exp_name=exp, **COMMON, **extra))
            s.update(final_pass_at_k(Path(out) / exp, seed))
            s.setdefault("rollouts_sampled", extra["steps"] * PROMPTS * extra["group_size"])
            append_rows(CSV, NAME, f"algos/{script}.py", label, seed, s,
                        f"python algos/{script}.py --prompts-per-step {PROMPTS} --eval-every 25 --eval-examples "
                        f"{EVAL_N} --pass-k 0 --no-eval-hard --threads 1 {flags(extra)} --seed {seed}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    ks = " | ".join(f"pass@{k}" for k in KS)
    lines = [f"| arm | rollouts | batches | greedy acc start | end | {ks} | unsolved prompts | hard prompts' share of "
             f"sum abs(A) (stage 1 -> both) | wall s | seeds |",
             "|---|---|---|---|---|" + "---|" * len(KS) + "---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        share = (f"{mean_std(get('hard_adv_share_stage1'), 100)} -> {mean_std(get('hard_adv_share'), 100)}"
                 if get("hard_adv_share") else "-")
        steps = get("steps_done") or [ARMS[label][1]["steps"]] * len(runs)
        lines.append(f"| {label} | {mean_std(get('rollouts_sampled'), 1, 0)} | {mean_std(steps, 1, 0)} | "
                     f"{mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     + " | ".join(mean_std(get(f"pass@{k}"), 100) for k in KS) +
                     f" | {mean_std(get('unsolved_frac'), 100)} | {share} | {mean_std(get('wall_s'), 1, 0)} | "
                     f"{len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"In %, mean ± std over seeds. tiny-0.6m on 2-digit `add`, {PROMPTS} prompts per rollout batch, lr "
              f"1e-4, every arm {BUDGET:,} sampled sequences (DARS stops at the first batch that reaches them, both "
              f"stages counted). pass@k: the unbiased estimator from {N_SAMPLES} samples per prompt at temperature 1 "
              f"on {EVAL_N} held-out prompts, from the final weights; unsolved: prompts with no correct sample in "
              f"{N_SAMPLES}; greedy accuracy on the same prompts. DARS: G = 8 first-stage rollouts, prompts below 50% "
              f"accuracy sampled again up to equal treatment's N (32 at 0/8, 12 at 1/8, 9 at 2/8 under the std), one "
              f"group per prompt for the advantage; the share column is the hard prompts' part of the batch's "
              f"sum |A| from the first stage alone and with both stages. Hardware: {row['hardware']} (shared); "
              f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/dars_table.py`."]
    cols = [("greedy acc end", "eval_acc_end", 100, 1)] + [(f"pass@{k}", f"pass@{k}", 100, 1) for k in KS]
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
