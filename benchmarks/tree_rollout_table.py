"""Tree rollouts against independent sampling (GRPO) at equal G and steps on the long-response task.

    python benchmarks/tree_rollout_table.py                          # 3 seeds x (grpo, tree, latr) + the table
    python benchmarks/tree_rollout_table.py --arms treerl treepo     # the advantage modes
    python benchmarks/tree_rollout_table.py --arms even3 pq3         # TRACE-style p(1 - p) allocation
    python benchmarks/tree_rollout_table.py --report-only            # rebuilds the table from the CSV

The arms run algos/tree_rollout_grpo.py and its children (each a copy of it that changes one idea, so everything
but that idea is the same code):
  grpo     tree_rollout_grpo.py --rounds 0 --chains 16   16 independent completions: grpo.py with G = 16 (a test
                                                         checks that depth 0 is grpo.py, metric for metric)
  tree     tree_rollout_grpo.py: 4 chains, 1 round, 1 point x 3 continuations per tree, entropy score, resampled
           branch token, GRPO's advantage over the 16 leaves (EPTree-shaped trees, TreeRL)
  latr     tree_rollout_latr.py --branch-token force --lookahead 4   forced untried candidates + lookahead pruning
  treerl   tree_rollout_adv.py --adv treerl              TreeRL's segment advantages (global + local, / sqrt |L|)
  treepo   tree_rollout_adv.py --adv treepo              TreePO's ancestor-subgroup advantages, whitened
  even3    tree_rollout_grpo.py --rounds 3 --continuations 1   three rounds of one point x one continuation per tree
  pq3      tree_rollout_alloc.py --rounds 3 --continuations 1  a round's points split by p(1 - p) of each tree's
                                                               success so far (TRACE-style)
Setting: tiny-sums on `sums` (5 one-digit operands with running totals, ~33-token answers), 48-token budget,
PROMPTS prompts x 16 leaves per step for STEPS steps (fewer than the default's 50 x 16, to fit the CPU budget), lr
1e-4, held-out greedy accuracy on EVAL_N prompts every EVAL_EVERY steps. Target: the start accuracy + TARGET
points; steps and sampled tokens to reach it are read from the eval curve (a run that never reaches it is
counted at STEPS + EVAL_EVERY, a lower bound, and the table says how many runs reached it).
Steps and tokens to a target are quantised to the evaluation interval and censor the runs that never get there, so
from seeds 30 on each run also records the area under its accuracy curve, divided by the budget: against steps
(`acc_auc_steps`, the mean held-out accuracy over the run) and against sampled tokens up to TOKEN_BUDGET, which every
arm reaches (`acc_auc_tokens`). Seeds 30-35 of grpo, tree and latr are the pilot of the claims plan's paired tests of
them (latr > grpo over the steps, tree > grpo over the tokens), which run on fresh seeds.
Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): LATR's diversity row (distinct answers per
group, latr > grpo; both samplers from the same policy on the same prompts of a seed) is a paired t test on the
per-seed differences of `--arms grpo latr --seeds 20 21 22`.

Writes benchmarks/results/tree_rollout.csv (rows through benchmarks/_results.py) and tree_rollout.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, fresh_run_tables, mean_over_budget, mean_std,  # noqa: E402
                                 read_rows, split_runs)

CSV, NAME = "tree_rollout.csv", "tree_rollout"
PLAN_RUNS = ((10, 19), (20, 22), (30, 35), (40, 60))  # the claims plan's runs on seeds of their own
PILOTS = {(30, 35): "the pilot of the claims plan's comparisons of the mean accuracy over the steps and the tokens"}
PROMPTS, STEPS, EVAL_EVERY, EVAL_N, TARGET = 8, 25, 5, 200, 0.05
TOKEN_BUDGET = 60_000  # sampled tokens every arm reaches within STEPS (the trees sample ~2,500 a step, GRPO ~4,200)
ARMS = {  # arm -> (the script in algos/, its flags)
    "grpo": ("tree_rollout_grpo", dict(rounds=0, chains=16)), "tree": ("tree_rollout_grpo", {}),
    "latr": ("tree_rollout_latr", dict(branch_token="force", lookahead=4)),
    "treerl": ("tree_rollout_adv", dict(adv="treerl")), "treepo": ("tree_rollout_adv", dict(adv="treepo")),
    "even3": ("tree_rollout_grpo", dict(rounds=3, continuations=1)),
    "pq3": ("tree_rollout_alloc", dict(rounds=3, continuations=1))}
FLAGS = dict(prompts_per_step=PROMPTS, steps=STEPS, eval_every=EVAL_EVERY, eval_examples=EVAL_N, pass_k=0,
             eval_hard=False, threads=1)


def curve_figures(run_dir: Path, start: float) -> dict:
    """Steps and sampled tokens until held-out accuracy first reaches start + TARGET, the mean accuracy over the
    steps and over the first TOKEN_BUDGET sampled tokens (areas under the curve); per-step medians of times."""
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    tokens, out, by_step, by_tokens = 0.0, {"reached": 0.0}, [], []
    for r in rows:
        tokens += r.get("rollout/sampled_tokens", 0)
        if "eval/acc" in r:
            by_step.append((r["step"], r["eval/acc"]))
            by_tokens.append((tokens, r["eval/acc"]))
        if r["step"] > 0 and r.get("eval/acc", -1) >= start + TARGET - 1e-9 and not out["reached"]:
            out.update(reached=1.0, steps_to_target=float(r["step"]), tokens_to_target=tokens)
    out.update(acc_auc_steps=mean_over_budget(by_step, STEPS),
               acc_auc_tokens=mean_over_budget(by_tokens, TOKEN_BUDGET))
    if not out["reached"]:  # censored: a lower bound
        per_step = tokens / max(1, sum("rollout/sampled_tokens" in r for r in rows))
        out.update(steps_to_target=float(STEPS + EVAL_EVERY), tokens_to_target=tokens + EVAL_EVERY * per_step)
    train = [r for r in rows if "perf/gen_s" in r]
    out["gen_s_per_step"] = statistics.median(r["perf/gen_s"] for r in train)
    out["train_s_per_step"] = statistics.median(r["perf/train_s"] for r in train)
    out["sampled_tokens_per_step"] = statistics.mean(r["rollout/sampled_tokens"] for r in train)
    return out


def run(arms, seeds) -> None:
    import importlib

    for seed in seeds:
        for arm in arms:
            script, arm_flags = ARMS[arm]
            mod = importlib.import_module(f"algos.{script}")
            out = Path("runs/bench_tree") / f"s{seed}"
            s = mod.main(mod.Args(seed=seed, out_dir=str(out), exp_name=arm, **FLAGS, **arm_flags))
            s.update(curve_figures(out / arm, s["eval_acc_start"]))
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in arm_flags.items())
            cmd = (f"python algos/{script}.py {flags} --prompts-per-step {PROMPTS} --steps {STEPS} "
                   f"--eval-every {EVAL_EVERY} --eval-examples {EVAL_N} --pass-k 0 --no-eval-hard --threads 1 "
                   f"--seed {seed}").replace("  ", " ")
            append_rows(CSV, "tree_rollout", f"algos/{script}.py", arm, seed, s, cmd)


def report() -> None:
    by, meta = defaultdict(dict), {}  # arm -> seed -> metrics (a later row wins)
    for r in read_rows(CSV):
        by[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        meta[r["config"]] = r
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    base = by.get("grpo", {})
    lines = [f"| arm | held-out acc start | end | best | steps to +{100 * TARGET:.0f} (reached) | sampled tokens to "
             f"+{100 * TARGET:.0f} (x grpo) | sampled tokens / step | token-savings | mixed-reward groups | distinct "
             "answers / group | forced / pruned | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        runs = by.get(arm, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        ratio = [runs[s]["tokens_to_target"] / base[s]["tokens_to_target"] for s in runs if s in base]
        lines.append(
            f"| {arm} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
            f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('steps_to_target'), 1, 1)} "
            f"({int(sum(get('reached')))}/{len(runs)}) | {mean_std(get('tokens_to_target'), 1e-3, 0)}k "
            f"({mean_std(ratio, 1, 2)}) | {mean_std(get('sampled_tokens_per_step'), 1, 0)} | "
            f"{mean_std(get('token_savings'), 1, 2)} | {mean_std(get('mixed_group_frac'), 100)}% | "
            f"{mean_std(get('distinct_answers'), 1, 2)} | {mean_std(get('forced_frac'), 100, 0)}% / "
            f"{mean_std(get('pruned_frac'), 100, 0)}% | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Mean ± std over seeds; every arm has G = 16 leaves per prompt (grpo: `algos/tree_rollout_grpo.py "
              f"--rounds 0 --chains 16`, i.e. grpo.py; tree: `algos/tree_rollout_grpo.py`, 4 chains + 1 entropy-chosen "
              f"point x 3 resampled continuations per chain; latr: `algos/tree_rollout_latr.py --branch-token force "
              f"--lookahead 4`; treerl / treepo: `algos/tree_rollout_adv.py --adv treerl` / `--adv treepo` on the tree "
              f"arm's trees; even3 / pq3: `algos/tree_rollout_grpo.py` / `algos/tree_rollout_alloc.py` with `--rounds 3 "
              f"--continuations 1`, one point per tree and round, or a group's points split by p(1 - p) of each tree's "
              f"success so far). tiny-sums on `sums` (5 one-digit operands), {PROMPTS} "
              f"prompts per step, {STEPS} steps (the default runs 16 x 50), held-out greedy accuracy on {EVAL_N} "
              f"prompts every {EVAL_EVERY} steps. Target: start + {100 * TARGET:.0f} points; a run that never reaches "
              f"it counts as {STEPS + EVAL_EVERY} steps (a lower bound). Token-savings: leaf tokens / sampled tokens "
              f"(what 16 independent completions of the same lengths would sample); sampled tokens include LATR's "
              f"pruned windows. Hardware: {row['hardware']} (shared); {row['versions']}; commit {row['commit']}. "
              f"Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/tree_rollout_table.py`."]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("steps to target", "steps_to_target", 1, 1),
            ("sampled tokens to target (k)", "tokens_to_target", 1e-3, 0),
            ("distinct answers / group", "distinct_answers", 1, 2),
            ("mean acc over the steps", "acc_auc_steps", 100, 1),
            (f"mean acc over {TOKEN_BUDGET // 1000}k sampled tokens", "acc_auc_tokens", 100, 1)]
    for (lo, hi), part in parts[1:]:  # each run's table, then its comparison of the areas (from seeds 30 on)
        lines += fresh_run_tables([((lo, hi), part)], cols, ARMS, titles=PILOTS)
        if any("acc_auc_steps" in r for d in part.values() for r in d.values()):
            auc = lambda arm, m: [100 * r[m] for r in part.get(arm, {}).values()]  # noqa: E731
            lines += ["", f"Seeds {lo}-{hi}, each comparison alone (the claims table gives the verdicts): mean "
                      "held-out accuracy over the steps, latr minus grpo "
                      f"{compare(auc('latr', 'acc_auc_steps'), auc('grpo', 'acc_auc_steps'))}; over the first "
                      f"{TOKEN_BUDGET:,} sampled tokens, tree minus grpo "
                      f"{compare(auc('tree', 'acc_auc_tokens'), auc('grpo', 'acc_auc_tokens'))}."]
            if (lo, hi) == (40, 60):
                lines[-1] += (" These use all 21 seeds; the claims rows test the first 21 and 14 of them, what their "
                              "plans' power estimates asked for.")
    lines += ["", claims_text()]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def compare(a: list, b: list) -> str:
    """a minus b over per-seed values: the difference, its Welch 95% interval and where it lies (one decimal)."""
    from benchmarks.report import describe_comparison

    stat = lambda v: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))  # noqa: E731
    return describe_comparison("0>1", [stat(a), stat(b)], 1) if a and b else "-"


def claims_text() -> str:
    """The paper claims against these rows, each comparison alone: the difference of the seed means, its Welch 95%
    interval and where it lies (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    from benchmarks.report import describe_comparison, figure, fmt

    def side(arm, metric, scale, digits):
        # the first run's seeds, the main table's (the fresh runs start at PLAN_RUNS[0][0])
        m = figure(f"{CSV}#algos/{ARMS[arm][0]}.py#{arm}#{metric}#{scale}#seeds=0-{PLAN_RUNS[0][0] - 1}")
        return m, fmt(*m, digits)

    out = []
    for claim, spec, a, b, metric, scale, digits in (
            ("LATR learns faster (131%): steps to target", "0>1", "grpo", "latr", "steps_to_target", 1, 1),
            ("LATR ends higher (+4.2% pass@1): end accuracy", "0>1", "latr", "grpo", "eval_acc_end", 100, 1),
            ("LATR diversifies groups: distinct answers per group", "0>1", "latr", "grpo", "distinct_answers", 1, 2),
            ("shared prefixes save sampling (TreePO, TreeRL): sampled tokens to target", "0<1", "tree", "grpo",
             "tokens_to_target", 1e-3, 0),
            ("... at unchanged accuracy (TreePO): end accuracy", "0~1", "tree", "grpo", "eval_acc_end", 100, 1)):
        try:
            (ma, ta), (mb, tb) = side(a, metric, scale, digits), side(b, metric, scale, digits)
        except ValueError:  # an arm not run yet
            continue
        out.append(f"{claim}: {a} {ta} vs {b} {tb}, difference {describe_comparison(spec, [ma, mb], digits)}")
    return ("Paper claims here, each comparison on the first table's seeds alone (the claims table gives the "
            "verdicts): "
            + "; ".join(out) + ".")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--arms", nargs="+", default=["grpo", "tree", "latr"], choices=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args()
    if not a.report_only:
        run(a.arms, a.seeds)
    report()
