"""Semi-online RL against offline step-level training on the key-value lookup environment: held-out online success
and the semi-online score (SOP) at every checkpoint.

    python benchmarks/semi_online_table.py                       # semi-online and offline-bc x 3 seeds (one thread)
    python benchmarks/semi_online_table.py --arms online --seeds 0   # some runs (online: multi-turn GRPO, the parent)
    python benchmarks/semi_online_table.py --report-only         # rebuilds the table from the CSV

The claims ("UI-S1: Advancing GUI Automation via Semi-online Reinforcement Learning", arXiv:2509.11543): rollouts along
the expert's trajectories that keep the policy's own turns, patched where they diverge and trained with discounted
step returns and step- plus episode-level advantages, capture the multi-turn signal that offline step-level training
lacks; the Semi-Online Performance (SOP) read off patched rollouts aligns with true online performance.

Arms, all algos/semi_online.py from the shipped tiny-toolenv with its defaults (60 rollout batches of 16 seeds x G = 8
episodes, lr 2e-4, temperature 0.7, 300 held-out episodes every 30 batches), one thread:
  semi-online  --mode semi-online: patched rollouts, A = A^episode + A^step (gamma 0.5)
  offline-bc   --mode offline-bc: one row per expert step of 16 x 8 expert episodes per update, advantage 1
               (behaviour cloning of the expert's steps), as many updates
  online       --mode online: multi-turn GRPO (the parent, algos/multiturn_grpo.py's update), run after the
               other two (--arms online) for the described row below
The semi-online and offline-bc arms differ in what each update trains on (the policy's own patched turns with their
advantages, against the expert's turns with advantage 1): that is the paper's comparison.

The plan, fixed before the runs (its lines are in benchmarks/claims_plan.csv):
- held-out online success at the end: semi-online > offline-bc, effect 2.6 points (the abstract's gains are over the
  base model, not over offline training: the median of the gains that the claims table's accuracy rows quote).
- SOP beside online success: described (per run, SOP and online success at every checkpoint and the largest gap
  between them). On this deterministic environment a greedy held-out episode played without a patch is the online
  episode itself, so SOP <= online success, and the two differ only by online successes that took a step the match
  test rejects (a lookup of a key the query does not name, or of one already read). The agreement is close to
  automatic here, which is why the row describes it and does not test it.
- online success of semi-online RL beside online RL (the parent): described, 3 seeds (the abstract says semi-online
  RL bridges offline training and online multi-turn reasoning; it claims no ordering against online RL). Planned
  after the first two arms had run, before this arm ran.
- 3 seeds per arm (what the budget allows: about 15 minutes of one CPU thread for both arms).

Writes benchmarks/results/semi_online.csv (one row per run and metric; the checkpoints as acc_s<step>, sop_s<step>,
sop_progress_s<step>; sop_gap_max the largest |SOP - online success| over a run's checkpoints) and semi_online.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "semi_online.csv", "semi_online"
SEEDS = (0, 1, 2)
STEPS, EVAL_EVERY = 60, 30
OUT = "runs/bench_semi_online"
COMMON = dict(steps=STEPS, eval_every=EVAL_EVERY, threads=1)
FLAGS = f"--steps {STEPS} --eval-every {EVAL_EVERY} --threads 1"
ARMS = {"semi-online": "semi-online", "offline-bc": "offline-bc", "online": "online"}
DEFAULT_ARMS = ("semi-online", "offline-bc")


def run_figures(run_dir: Path) -> dict:
    """The run's checkpoints: online success (acc_s<step>), SOP (sop_s<step>), SOP progress (sop_progress_s<step>),
    and the largest |SOP - online success| over them (sop_gap_max)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    evals = [r for r in rows if "eval/sop" in r]
    out = {}
    for r in evals:
        out.update({f"acc_s{r['step']}": r["eval/acc"], f"sop_s{r['step']}": r["eval/sop"],
                    f"sop_progress_s{r['step']}": r["eval/sop_progress"]})
    if evals:
        out["sop_gap_max"] = max(abs(r["eval/sop"] - r["eval/acc"]) for r in evals)
    return out


def run(seeds, arms) -> None:
    from algos import semi_online as so

    for seed in seeds:
        for label in arms:
            mode = ARMS[label]
            out, exp = f"{OUT}/s{seed}", label
            s = so.main(so.Args(mode=mode, seed=seed, out_dir=out, exp_name=exp, **COMMON))
            s.update(run_figures(Path(out) / exp))
            append_rows(CSV, NAME, "algos/semi_online.py", label, seed, s,
                        f"python algos/semi_online.py --mode {mode} {FLAGS} --seed {seed}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    steps = list(range(0, STEPS + 1, EVAL_EVERY))
    lines = ["| arm | held-out online success start | end | SOP start | end | SOP progress start | end | "
             "largest \\|SOP - online\\| | answer-turn acc end | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_sop_start'), 100)} | {mean_std(get('eval_sop_end'), 100)} | "
                     f"{mean_std(get('eval_sop_progress_start'), 100)} | "
                     f"{mean_std(get('eval_sop_progress_end'), 100)} | "
                     f"{mean_std(get('sop_gap_max'), 100)} | {mean_std(get('eval_turn4_acc_end'), 100)} | "
                     f"{mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    lines += ["", "| arm | seed | " + " | ".join(f"online / SOP at {s}" for s in steps) + " |",
              "|---|---|" + "---|" * len(steps)]
    for label in ARMS:
        for seed, r in sorted(by.get(label, {}).items()):
            cells = [f"{100 * r[f'acc_s{s}']:.1f} / {100 * r[f'sop_s{s}']:.1f}" if f"acc_s{s}" in r else "-"
                     for s in steps]
            lines.append(f"| {label} | {seed} | " + " | ".join(cells) + " |")
    row = next(meta[label] for label in ARMS if label in meta)
    commits = "; ".join(f"{meta[label]['commit']} ({label})" for label in ARMS if label in meta)
    lines += ["", f"Held-out greedy online success, SOP and SOP progress in % on 300 held-out episodes, mean ± std "
              f"over seeds. `algos/semi_online.py` defaults: tiny-toolenv on `algos/_toolenv.py`'s lookup (the sum of "
              f"3 of 4 hidden one-digit values, turn limit 5), {STEPS} rollout batches of 16 seeds x G = 8 episodes, "
              f"lr 2e-4, temperature 0.7, evaluated every {EVAL_EVERY} batches. semi-online: patched rollouts along "
              f"the scripted expert (gamma 0.5, A = A^episode + A^step); offline-bc: behaviour cloning of the expert's "
              f"steps (16 x 8 expert episodes per update); online: multi-turn GRPO. SOP: the share of greedy patched "
              f"held-out episodes solved without a patch; SOP progress: the share of the 4 expert steps taken before "
              f"the first patch. Answer-turn accuracy: teacher-forced, on the expert's history. Hardware: "
              f"{row['hardware']} (shared); {row['versions']}; commits {commits}. Rows: "
              f"`benchmarks/results/{CSV}`; command: `python benchmarks/semi_online_table.py`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
