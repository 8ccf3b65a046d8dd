"""BranchGRPO against DanceGRPO on the 2-D flow task: model calls (NFE) per iteration, reward, iteration time.

    python benchmarks/branch_flow_table.py                  # 3 seeds x 6 arms of training + the timing runs
    python benchmarks/branch_flow_table.py --report-only    # rebuilds the table from the CSV
    python benchmarks/branch_flow_table.py --plan --seeds 10 11 12   # the claims plan's fresh run

--plan: the fresh seeds that benchmarks/claims_plan.csv asks for (the training of DanceGRPO, BranchGRPO, + pruning
and Mix only; rows under the bench `branch_flow_plan`, reported in a table of their own), so that they neither pool
with the first runs' seeds nor stand in for them.

The claims ("BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models",
arXiv:2509.06040): tree rollouts with shared prefixes, reward fusion and depth-wise advantages align better than
DanceGRPO (up to 16% on HPDv2.1), width and depth pruning cut the per-iteration training time by nearly 55%, and
the Mix variant (a sliding SDE window) trains 4.7x faster than DanceGRPO. Arms (algos/branch_grpo_flow.py, one
file, so the sampler, the model and the loss are the same code):
  DanceGRPO                     --mode dance: 16 independent SDE chains per prompt from one shared start noise
  BranchGRPO                    splits at steps 0 3 6 9, factor 2 (16 leaves), mean fusion, depth-wise advantage
  BranchGRPO + pruning          + --width-keep 0.5 --depth-prune 16 17 18 19 20
  BranchGRPO, uniform advantage --advantage uniform (each leaf's GRPO advantage on its whole path)
  BranchGRPO, prob. fusion      --fusion prob (children weighted by the softmax of their log-probs)
  BranchGRPO-Mix                --mix-window 6 (SDE and training only in a 6-step window sliding over iterations)
Training: each script default (20 SDE steps, 8 prompts of 8 modes per iteration, 150 iterations, lr 3e-4),
one thread. Timing: the same arms at 64 prompts per iteration (where the arithmetic, not per-call overhead,
sets the time), 10 iterations, one thread, the arms interleaved within each seed; iteration time = rollout +
training wall time, averaged over the iterations; each arm's iteration time over DanceGRPO's of the same seed
(iter_x_dance) is the paired figure the timing claims are decided on, since the shared machine's load moves both.

Writes benchmarks/results/branch_flow.csv (rows through benchmarks/_results.py) and branch_flow.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "branch_flow.csv", "branch_flow"
RUNS = ROOT / "runs" / "bench_branch_flow"
PRUNE = {"width_keep": 0.5, "depth_prune": (16, 17, 18, 19, 20)}
ARMS = {"DanceGRPO": {"mode": "dance"}, "BranchGRPO": {}, "BranchGRPO + pruning": PRUNE,
        "BranchGRPO, uniform advantage": {"advantage": "uniform"}, "BranchGRPO, prob. fusion": {"fusion": "prob"},
        "BranchGRPO-Mix": {"mix_window": 6}}
TIMED = ("DanceGRPO", "BranchGRPO", "BranchGRPO + pruning", "BranchGRPO-Mix")
TIME_FLAGS = {"prompts_per_iter": 64, "iters": 10, "eval_every": 1000, "eval_per_mode": 8}
SEEDS = (0, 1, 2)
PLAN, PLAN_ARMS = "branch_flow_plan", ("DanceGRPO", "BranchGRPO", "BranchGRPO + pruning", "BranchGRPO-Mix")


def flags_of(kw: dict) -> str:
    out = []
    for k, v in kw.items():
        out.append(f"--{k.replace('_', '-')} " + (" ".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    return " ".join(out)


def exp_name(label: str) -> str:
    return label.replace(" ", "_").replace(",", "").replace(".", "")


def train(seed: int, arms, bench: str, sub: str, save_png: bool) -> None:
    """Each arm's training run at the script defaults, one row set per arm under `bench`."""
    from algos import branch_grpo_flow as bf

    shutil.rmtree(RUNS / sub, ignore_errors=True)  # the tracker appends to metrics.jsonl
    for label in arms:
        kw = ARMS[label]
        s = bf.main(bf.Args(seed=seed, threads=1, out_dir=str(RUNS / sub), save_png=save_png,
                            exp_name=exp_name(label), **kw))
        cmd = f"python algos/branch_grpo_flow.py {flags_of(kw)} --threads 1 --seed {seed}".replace("  ", " ")
        append_rows(CSV, bench, "algos/branch_grpo_flow.py", f"train | {label}", seed, s, cmd)


def run(seeds, timing_only: bool, plan: bool = False) -> None:
    from algos import branch_grpo_flow as bf

    for seed in seeds:
        if plan:  # the claims plan's fresh seeds: training only, under a bench of their own
            train(seed, PLAN_ARMS, PLAN, f"plan_s{seed}", False)
            continue
        if not timing_only:
            train(seed, ARMS, "branch_flow_train", f"s{seed}", seed == 0)
        shutil.rmtree(RUNS / f"time_s{seed}", ignore_errors=True)
        dance_s = None
        for label in TIMED:  # DanceGRPO first: each arm's time is also written as a ratio to it (same seed, interleaved)
            kw = {**ARMS[label], **TIME_FLAGS}
            args = bf.Args(seed=seed, threads=1, out_dir=str(RUNS / f"time_s{seed}"), save_png=False,
                           exp_name=exp_name(label), **kw)
            s = bf.main(args)
            dance_s = dance_s or s["iter_s"]
            s["iter_x_dance"] = s["iter_s"] / dance_s
            cmd = f"python algos/branch_grpo_flow.py {flags_of(kw)} --threads 1 --seed {seed}"
            append_rows(CSV, "branch_flow_time", "algos/branch_grpo_flow.py", f"time P=64 | {label}", seed, s, cmd)


def collect(benches=("branch_flow_train", "branch_flow_time")):
    """config -> seed -> metrics of the given benches (the first runs: the plan's fresh seeds apart), and provenance."""
    by, meta = {}, {}
    for bench in benches:
        b, m = by_config_seed(CSV, bench)
        by.update(b)
        meta.update(m)
    return by, meta


def report() -> None:
    by, meta = collect()
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    f = mean_std
    lines = ["| arm | rollout NFE / iter | training NFE / iter | rollout NFE per leaf (x DanceGRPO) | reward start | "
             "reward, mean over training evals | reward end | ODE reward end | iteration ms | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = list(by.get(f"train | {label}", {}).values())
        if not runs:
            continue
        g = lambda k: [r[k] for r in runs]  # noqa: E731
        lines.append(f"| {label} | {f(g('rollout_nfe_per_iter'), 1, 0)} | {f(g('train_nfe_per_iter'), 1, 0)} | "
                     f"{f(g('rollout_nfe_per_leaf'), 1, 2)} ({f(g('nfe_ratio'), 1, 2)}) | "
                     f"{f(g('reward_start'), 1, 3)} | {f(g('reward_auc'), 1, 3)} | {f(g('reward_end'), 1, 3)} | "
                     f"{f(g('reward_ode_end'), 1, 3)} | "
                     f"{f(g('iter_s'), 1e3, 1)} | {len(runs)} |")
    lines += ["", "| arm (64 prompts per iteration) | rollout ms | training ms | iteration ms | x DanceGRPO | seeds |",
              "|---|---|---|---|---|---|"]
    dance = by.get("time P=64 | DanceGRPO", {})
    for label in TIMED:
        runs = by.get(f"time P=64 | {label}", {})
        if not runs:
            continue
        g = lambda k: [r[k] for r in runs.values()]  # noqa: E731
        ratio = [runs[s]["iter_s"] / dance[s]["iter_s"] for s in runs if s in dance]
        lines.append(f"| {label} | {f(g('rollout_s'), 1e3, 1)} | {f(g('train_s'), 1e3, 1)} | "
                     f"{f(g('iter_s'), 1e3, 1)} | {f(ratio, 1, 2)} | {len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", "2-D flow matching, 8 Gaussians on a ring; a prompt is a mode, reward exp(-|x - mu_c|^2 / 0.5); "
              "pretrained flow follows its prompt loosely (40% of its pretraining labels right). Training: each "
              "arm's flags on the script defaults (20 SDE steps, 16 leaves per prompt, 8 prompts per iteration, 150 "
              "iterations, lr 3e-4, PPO clip 0.2, one update pass in 4 mini-batches); rewards are the mean over 512 "
              "SDE samples (64 per mode) from fixed noise, evaluated every 25 iterations. NFE = model calls; "
              "training NFE counts one forward per parent node with a trained edge. Timing table: 64 prompts per "
              f"iteration, 10 iterations, the arms interleaved per seed. Hardware: {row['hardware']} (shared with "
              f"other jobs; one thread per run); {row['versions']}; commit {row['commit']}. Rows: "
              f"`benchmarks/results/{CSV}`; command: `python benchmarks/branch_flow_table.py`."]
    lines += verdicts(by)
    fresh = collect((PLAN,))[0]
    if fresh:
        lines += ["", "The claims plan's fresh run (`--plan`: its own seeds, training only):", "",
                  "| arm | reward end | seeds |", "|---|---|---|"]
        lines += [f"| {label} | {f([r['reward_end'] for r in fresh[f'train | {label}'].values()], 1, 3)} | "
                  f"{', '.join(sorted(fresh[f'train | {label}'], key=int))} |" for label in PLAN_ARMS
                  if f"train | {label}" in fresh]
    if plot() or (RESULTS / f"{NAME}.png").exists():  # without runs/ the committed plot stays
        lines += ["", "![reward against iterations and rollout model calls](results/branch_flow.png)"]
    samples = RUNS / "s0" / "BranchGRPO" / "branch_grpo_flow.png"
    if samples.exists():
        shutil.copy(samples, RESULTS / "branch_flow_samples.png")
    if (RESULTS / "branch_flow_samples.png").exists():
        lines += ["", "![BranchGRPO, seed 0: samples before and after, reward curve](results/branch_flow_samples.png)"]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot() -> bool:
    """Mean eval reward over seeds against iterations and against cumulative rollout model calls, from the runs'
    metrics.jsonl (kept under runs/; without them the committed PNG stays)."""
    curves = {}
    for label in ARMS:
        per_seed = []
        for path in sorted(RUNS.glob(f"s*/{exp_name(label)}/metrics.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            nfe = next(r["perf/rollout_nfe"] for r in rows if "perf/rollout_nfe" in r)
            per_seed.append([(r["step"], r["step"] * nfe, r["eval/reward"]) for r in rows if "eval/reward" in r])
        if per_seed and all(len(p) == len(per_seed[0]) for p in per_seed):
            curves[label] = [(p[0][0], p[0][1], sum(q[i][2] for q in per_seed) / len(per_seed))
                             for i, p in enumerate(zip(*per_seed))]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, pts in curves.items():
        style = "k--" if label == "DanceGRPO" else "o-"
        axes[0].plot([p[0] for p in pts], [p[2] for p in pts], style, label=label, ms=3)
        axes[1].plot([p[1] / 1e3 for p in pts], [p[2] for p in pts], style, label=label, ms=3)
    axes[0].set(xlabel="iteration", ylabel="eval reward (mean over seeds)", title="reward per iteration")
    axes[1].set(xlabel="rollout model calls (thousands)", title="reward per rollout model call")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=90)
    plt.close(fig)
    return True


def verdicts(by) -> list[str]:
    """The paper's claims against these rows, each comparison alone: the difference of the seed means, its Welch 95%
    interval and where it lies (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    import statistics as st

    from benchmarks.report import describe_comparison

    def fig(arm, key, scale=1.0):
        vals = [r[key] * scale for r in by.get(arm, {}).values()]
        return (st.mean(vals), st.stdev(vals) if len(vals) > 1 else 0.0, len(vals)) if vals else (float("nan"), 0, 1)

    def says(a, b, cmp, digits=3):
        return describe_comparison(f"0{cmp}1", [a, b], digits)

    tr, tm = "train | ", "time P=64 | "
    end = {a: fig(tr + a, "reward_end") for a in ARMS}
    auc = {a: fig(tr + a, "reward_auc") for a in ARMS}
    t = {a: fig(tm + a, "iter_x_dance") for a in TIMED}  # paired: over DanceGRPO's time in the same seed
    nfe = fig(tr + "BranchGRPO", "nfe_ratio")[0]
    return ["", "Paper claims, each comparison on this table's seeds alone (the first arm minus the second; the "
            f"claims table gives the verdicts): fewer rollout model calls: {nfe:.2f}x "
            "DanceGRPO's per leaf (counted; the plot shows reward against rollout model calls); iteration time in "
            "DanceGRPO's of the same seed (wall-clock on a shared CPU, so a description only), lower with pruning: "
            f"{says(t['BranchGRPO + pruning'], t['DanceGRPO'], '<', 2)} "
            f"({t['BranchGRPO + pruning'][0]:.2f}x per seed, the paper about 0.45x); with Mix: "
            f"{says(t['BranchGRPO-Mix'], t['DanceGRPO'], '<', 2)} ({t['BranchGRPO-Mix'][0]:.2f}x "
            f"per iteration); higher final reward than DanceGRPO at equal iterations: "
            f"{says(end['BranchGRPO'], end['DanceGRPO'], '>')} ({end['BranchGRPO'][0]:.3f} vs "
            f"{end['DanceGRPO'][0]:.3f}; mean reward over the training evals {auc['BranchGRPO'][0]:.3f} vs "
            f"{auc['DanceGRPO'][0]:.3f}); depth-wise better than uniform "
            f"advantage: {says(auc['BranchGRPO'], auc['BranchGRPO, uniform advantage'], '>')} "
            f"({auc['BranchGRPO'][0]:.3f} vs {auc['BranchGRPO, uniform advantage'][0]:.3f}); pruning keeps the final "
            f"reward: {says(end['BranchGRPO + pruning'], end['BranchGRPO'], '~')} "
            f"({end['BranchGRPO + pruning'][0]:.3f} vs {end['BranchGRPO'][0]:.3f}); Mix keeps it: "
            f"{says(end['BranchGRPO-Mix'], end['DanceGRPO'], '~')} ({end['BranchGRPO-Mix'][0]:.3f} vs "
            f"{end['DanceGRPO'][0]:.3f}). At 64 prompts part of an iteration is still per-call overhead, which "
            "pruning does not remove."]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--timing-only", action="store_true", help="only the timing runs (64 prompts per iteration)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--plan", action="store_true",
                    help="the claims plan's fresh run: training of its four arms at --seeds, under the bench "
                         "branch_flow_plan")
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.timing_only, a.plan)
    report()
