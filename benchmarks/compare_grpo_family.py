"""The GRPO family side by side: GRPO (each --loss-agg), Dr. GRPO, DAPO, GSPO, RLOO and PPO on the tiny default.

    python benchmarks/compare_grpo_family.py                 # every method x 3 seeds (see the caption's budget)
    python benchmarks/compare_grpo_family.py --report-only   # rebuilds the table and the plot from the CSV
    python benchmarks/report.py                              # puts the table into benchmarks/README.md

Fairness: every method samples the same number of sequences. Each rollout batch is 32 prompts x 8 samples
(PPO: 256 prompts x 1, its critic replaces the group); DAPO's dynamic sampling spends more sequences per
step, so DAPO runs under --rollout-budget = steps x 256 and stops early. Same model, task, lr (1e-4),
held-out prompts (500, greedy) and threads for all.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): DAPO > GRPO (seq-mean) in held-out accuracy is
a paired t test on the per-seed differences of
`--methods DAPO "GRPO (seq-mean)" --steps 40 --eval-every 10 --threads 1 --seeds 20 21 22 23 24 25 26 27 28 29`.

Writes benchmarks/results/grpo_family.csv (rows with provenance, including the held-out accuracy curve as
`acc_at_rollouts_<N>` figures), benchmarks/results/grpo_family.md and benchmarks/results/grpo_family.png.
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

from benchmarks._results import (RESULTS, append_rows, by_config_seed, fresh_run_tables, mean_std,  # noqa: E402
                                 split_runs)

CSV = "grpo_family.csv"
SEEDS = (0, 1, 2)
PLAN_RUNS = ((10, 19), (20, 29), (100, 134), (300, 407))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
PROMPTS, GROUP = 32, 8
# label -> (script, flags); flags are Args fields (the command line spells them with dashes)
METHODS = {
    "GRPO (seq-mean)": ("grpo", {}),
    "GRPO (token-mean)": ("grpo", {"loss_agg": "token-mean"}),
    "GRPO (const 1/k)": ("grpo", {"loss_agg": "const"}),
    "Dr. GRPO": ("grpo", {"loss_agg": "const", "adv_std_norm": False}),
    "DAPO": ("dapo", {}),
    "GSPO": ("gspo", {}),
    "RLOO": ("rloo", {}),
    "PPO": ("ppo", {"prompts_per_step": PROMPTS * GROUP, "group_size": 1}),
}


def flags_text(flags: dict) -> str:
    out = []
    for k, v in flags.items():
        name = "--" + k.replace("_", "-")
        out.append(name if v is True else f"--no-{name[2:]}" if v is False else f"{name} {v}")
    return " ".join(out)


def curve_from_metrics(path: Path, per_step: int) -> dict:
    """acc_at_rollouts_<N> (N = sequences sampled so far) and the informative-group count from metrics.jsonl."""
    out, sampled, informative, groups = {}, 0, 0.0, 0
    for r in map(json.loads, open(path)):
        if "rollout/sampled" in r:  # DAPO logs what it sampled; the others sample per_step sequences per step
            sampled += r["rollout/sampled"]
            informative += r["rollout/informative_groups"]
        elif "rollout/reward" in r:
            sampled += per_step
            if "rollout/zero_var_group_frac" in r:
                informative += (1 - r["rollout/zero_var_group_frac"]) * PROMPTS
        if "eval/acc" in r:
            out[f"acc_at_rollouts_{sampled}"] = r["eval/acc"]
    out["rollouts_sampled"] = sampled
    if informative:
        out["rollouts_per_informative_group"] = sampled / informative
    return out


def run(seeds, steps: int, threads: int, eval_every: int, methods) -> None:
    import importlib

    budget = steps * PROMPTS * GROUP
    for seed in seeds:
        for label in methods:
            script, flags = METHODS[label]
            mod = importlib.import_module(f"algos.{script}")
            extra = {"rollout_budget": budget, "steps": 10 * steps} if script == "dapo" else {"steps": steps}
            common = dict(seed=seed, eval_every=eval_every, eval_examples=500, pass_k=0, eval_hard=False,
                          threads=threads, out_dir=f"runs/bench_grpo_family/s{seed}",
                          exp_name=label.lower().replace(" ", "_").replace(".", "").replace("(", "").replace(")", "")
                          .replace("/", ""))
            args = mod.Args(**{**common, **extra, **flags})
            s = mod.main(args)
            s.update(curve_from_metrics(Path(args.out_dir) / args.exp_name / "metrics.jsonl",
                                        args.prompts_per_step * args.group_size))
            cmd = (f"python algos/{script}.py {flags_text({**flags, **extra})} --seed {seed} --eval-every {eval_every} "
                   f"--pass-k 0 --no-eval-hard --threads {threads}")
            append_rows(CSV, "grpo_family", f"algos/{script}.py", label, seed, s, cmd.replace("  ", " "))


def fmt(vals, pct=True, digits=1):
    return mean_std(vals, 100 if pct else 1, digits, bare_single=False)


def collect():
    return by_config_seed(CSV)


def report() -> None:
    by, meta = collect()
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    lines = ["| method | command | held-out acc end | best | gain (points) | generated tokens | rollouts per "
             "informative group | steps (rollout rounds) | wall s | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label in METHODS:
        if label not in by:
            continue
        runs = list(by[label].values())
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        gains = [r["eval_acc_end"] - r["eval_acc_start"] for r in runs]
        script, flags = METHODS[label]
        steps = [r.get("steps_done", max(int(k.split("_")[-1]) for k in r if k.startswith("acc_at_rollouts_"))
                       // (PROMPTS * GROUP)) for r in runs]
        rpig = get("rollouts_per_informative_group")
        cmd = f"algos/{script}.py {flags_text(flags)}".strip()
        lines.append(f"| {label} | `{cmd}` | {fmt(get('eval_acc_end'))} | {fmt(get('eval_acc_best'))} | {fmt(gains)} | "
                     f"{fmt(get('gen_tokens'), False, 0)} | {fmt(rpig, False, 2) if rpig else '- (no groups)'} | "
                     f"{statistics.mean(steps):.0f} | {fmt(get('wall_s'), False, 0)} | {len(runs)} |")
    if meta:
        any_row = next(iter(meta.values()))
        n_seq = max(int(k.split("_")[-1]) for r in by[next(iter(by))].values() for k in r
                    if k.startswith("acc_at_rollouts_"))
        lines += ["", f"Budget: {n_seq} sampled sequences per run ({n_seq // (PROMPTS * GROUP)} rollout batches of "
                  f"{PROMPTS} prompts x {GROUP}; PPO 256 prompts x 1; DAPO stops when its dynamic sampling has spent "
                  f"the same {n_seq}), a reduced budget against the scripts' default 400 batches so that the whole "
                  f"comparison fits the shared 2-core machine. Task `add` (2-digit addition), `tiny-0.6m`, lr 1e-4, "
                  f"500 held-out prompts, greedy; start accuracy 35.8%. Mean ± std over seeds. Rollouts per "
                  f"informative group = sequences sampled / groups whose rewards were not all equal (for methods "
                  f"without dynamic sampling, zero-variance groups are still sampled and give no gradient). "
                  f"Hardware: {any_row['hardware']} shared with other jobs (wall times are not comparable across "
                  f"rows beyond a rough factor); {any_row['versions']}; commit {any_row['commit']}. Rows: "
                  f"`benchmarks/results/{CSV}`; command: `python benchmarks/compare_grpo_family.py`.",
                  "", "![GRPO family curves](results/grpo_family.png)"]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("best", "eval_acc_best", 100, 1)]
    lines += fresh_run_tables(parts[1:], cols, METHODS)
    (RESULTS / "grpo_family.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label in METHODS:
        if label not in by:
            continue
        curves = defaultdict(list)
        for r in by[label].values():
            for k, v in r.items():
                if k.startswith("acc_at_rollouts_"):
                    curves[int(k.split("_")[-1])].append(v)
        xs = sorted(curves)
        m = np.array([np.mean(curves[x]) for x in xs])
        sd = np.array([np.std(curves[x]) for x in xs])
        style = "--" if label.startswith(("GRPO", "Dr.")) else "-"
        line, = ax.plot(np.array(xs) / 1000, 100 * m, style, marker="o", ms=3, label=label)
        ax.fill_between(np.array(xs) / 1000, 100 * (m - sd), 100 * (m + sd), color=line.get_color(), alpha=0.12)
    ax.set(xlabel="sequences sampled (thousands)", ylabel="held-out greedy accuracy (%)",
           title="GRPO family on 2-digit addition (tiny-0.6m), mean ± std over seeds")
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "grpo_family.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table and the plot from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--steps", type=int, default=200, help="rollout batches per run (DAPO: the same sequences)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.steps, a.threads, a.eval_every, a.methods)
    report()
