"""ECHO's tree rollouts for test-time RL: entropy-confidence hybrid branching with confidence pruning against
entropy-only branching, at equal sampled tokens, on effective branches and true held-out accuracy.

    python benchmarks/ttrl_echo_table.py                  # 3 arms x 3 seeds (about 25 minutes on 2 shared cores)
    python benchmarks/ttrl_echo_table.py --arms "ECHO trees" --seeds 0   # some runs
    python benchmarks/ttrl_echo_table.py --report-only    # rebuilds the table and the plot from the CSV

The claim (Zhao et al., "ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning",
arXiv:2602.02150): branching at high-entropy tokens concentrates the branching budget on a few trajectories with
consecutive high-entropy segments, so the number of effective branches falls (rollout collapse); setting the branch
width from local entropy and group confidence together, and ending persistently low-confidence branches, avoids it,
and ECHO (with its confidence-adaptive clip and hybrid advantage shaping) generalises better under a limited rollout
budget. The abstract gives no figures.

Arms, all algos/ttrl.py at its defaults (TTRL's majority vote, tiny-5m on 2-digit `add`, trained on the held-out
split without its answers, 32 prompts x 8 completions per rollout batch, lr 1e-5), each stopped once it has sampled
BUDGET tokens (a tree's shared prefixes count once), held-out greedy accuracy on 300 prompts every EVAL_EVERY batches
and at the end:
  ECHO trees      --rollout tree-echo: 2 chains per prompt grown to 8 unpruned leaves; width from entropy and group
                  confidence, confidence pruning, adaptive clip, hybrid advantage shaping
  entropy trees   --rollout tree-entropy: the same trees with the width from entropy alone, no pruning, GRPO's update
  TTRL (group)    --rollout group: 8 independent completions per prompt (reference)

The plan, fixed before these runs (its lines are in benchmarks/claims_plan.csv):
- "hybrid branching keeps more effective branches": `effective_branches` (distinct unpruned leaf sequences per tree,
  the run's mean), direction ECHO trees > entropy trees, effect 20% (no figure in the abstract).
- "ECHO ends more accurate at an equal token budget": `eval_acc_end`, direction ECHO trees > entropy trees, effect
  2.6 held-out points (no figure in the abstract).
- 3 seeds per arm, the budget here; no pilot spreads.

Writes benchmarks/results/ttrl_echo.csv (one row per run and metric; the eval curve as acc_s<step>), ttrl_echo.md and
ttrl_echo.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "ttrl_echo.csv", "ttrl_echo"
SEEDS = (0, 1, 2)
BUDGET, STEPS, EVAL_EVERY = 12000, 100, 10
COMMON = dict(token_budget=BUDGET, steps=STEPS, eval_every=EVAL_EVERY, eval_examples=300, pass_k=0, eval_hard=False,
              threads=1)
FLAGS = (f"--token-budget {BUDGET} --steps {STEPS} --eval-every {EVAL_EVERY} --eval-examples 300 --pass-k 0 "
         f"--no-eval-hard --threads 1")
ARMS = {"ECHO trees": "tree-echo", "entropy trees": "tree-entropy", "TTRL (group)": "group"}


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """[(step, held-out accuracy)] of one run, from its metrics.jsonl (step 0 = the start)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [(r["step"], r["eval/acc"]) for r in rows if "eval/acc" in r]


def run(seeds, arms) -> None:
    from algos import ttrl

    for seed in seeds:
        for label in arms:
            out, exp = f"runs/bench_ttrl_echo/s{seed}", ARMS[label]
            s = ttrl.main(ttrl.Args(seed=seed, out_dir=out, exp_name=exp, rollout=ARMS[label], **COMMON))
            s.update({f"acc_s{x}": y for x, y in curve(Path(out) / exp)})
            append_rows(CSV, NAME, "algos/ttrl.py", label, seed, s,
                        f"python algos/ttrl.py {FLAGS} --seed {seed} --rollout {ARMS[label]}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["| arm | effective branches per tree | first 10 batches | last 10 | leaves under the most branched chain | "
             "pruned leaves | held-out acc start | end | best | wrong-majority rate, last 10 | sampled accuracy, "
             "last 10 | rollout batches | sampled tokens | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        tree = lambda k, scale=1, nd=2: mean_std(get(k), scale, nd) if get(k) else "-"  # noqa: E731
        lines.append(f"| {label} | {tree('effective_branches')} | {tree('effective_branches_first')} | "
                     f"{tree('effective_branches_last')} | {tree('root_share', 100, 1)} | {tree('pruned_frac', 100, 1)} | "
                     f"{mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('wrong_majority_last'), 100)} | "
                     f"{mean_std(get('true_reward_last'), 100)} | {mean_std(get('batches'), 1, 0)} | "
                     f"{mean_std(get('gen_tokens'), 1, 0)} | {mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Mean ± std over seeds; shares in %. TTRL's majority-vote reward throughout; tiny-5m on 2-digit "
              f"`add`, trained on the held-out split without its answers, 32 prompts x 8 leaves (or completions) per "
              f"rollout batch, lr 1e-5, each run stopped once it had sampled {BUDGET:,} tokens (a tree's shared "
              f"prefixes counted once, a pruned leaf up to its cut; it then leaves its group). Effective branches: "
              f"distinct unpruned leaf "
              f"sequences per tree of 8, the run's mean (first and last 10 rollout batches beside it); leaves under "
              f"the most branched chain: the share of a tree's leaves that descend from the chain with most "
              f"(50% when the branching is spread over the 2 chains evenly, 100% when it all goes to one); pruned "
              f"leaves: their share of all leaves grown. "
              f"Held-out greedy accuracy on 300 prompts every {EVAL_EVERY} batches and at the end; wrong-majority "
              f"rate and sampled accuracy as in the TTRL table (the reference answers are read for these figures "
              f"only). algos/ttrl.py's header gives every rule and constant. Hardware: {row['hardware']} (shared); "
              f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/ttrl_echo_table.py`.", "",
              "![ECHO trees, entropy trees and the group rollout: held-out accuracy](results/ttrl_echo.png)"]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label in ARMS:
        runs = [{int(k[5:]): v for k, v in r.items() if k.startswith("acc_s")} for r in by.get(label, {}).values()]
        if not runs:
            continue
        xs = sorted(set.intersection(*(set(r) for r in runs)))
        ax.plot(xs, [100 * statistics.mean(r[x] for r in runs) for x in xs], "o-", ms=3, label=f"{label} ({len(runs)})")
    ax.set(xlabel="rollout batch (each arm stops at the same sampled tokens)", ylabel="held-out greedy accuracy, %",
           title="Test-time RL with tree rollouts, mean of seeds")
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
