"""SAC Flow: the gradient through K flow steps (plain, gated, decoded velocity) and SAC's score per actor.

    python benchmarks/flow_sac_table.py                  # the gradient table (16 init seeds) + 3 seeds x 6 SAC arms
    python benchmarks/flow_sac_table.py --part sac --jobs 2   # only the SAC runs, two processes at a time
    python benchmarks/flow_sac_table.py --part sac --arms Flow-G "plain flow" --seeds 20   # some SAC runs
    python benchmarks/flow_sac_table.py --report-only    # rebuilds the table and the plot from the CSV

The claims ("SAC Flow: Sample-Efficient Reinforcement Learning of Flow-Based Policies via Velocity-Reparameterized
Sequential Modeling", arXiv:2509.25756): a K-step flow rollout is a residual RNN, so the gradient through it explodes
or vanishes; a gated (Flow-G) or decoded (Flow-T) velocity keeps it stable, and SAC then trains the flow policy end to
end from scratch, at state-of-the-art returns. The abstract gives no figures. Two measurements
(algos/flow_sac.py, one file, so the rollout, the critic and the losses are the same code):

1. Gradient table: ||d a_K / d a_0|| and ||d a_K / d theta|| of the deterministic K-step flow (`rollout_grad_norms`)
   for freshly initialised velocities (`grad_norm_table`, hidden 64, 64 states) at K = 1, 2, 4, 8, 16, 32 and weight
   gain 1 (the default init) and 6 (a steep velocity, standing in for one that training has made steep); 16 init
   seeds per cell, each cell's figure the mean over seeds of log10 of the norm.
2. SAC: each arm's flags on the script defaults (2-D point-mass reaching, 8 environments, K = 8), 12k environment
   steps (half the default, for the benchmark's time budget), seeds 0, 1, 2, one thread per run:
     Flow-G, plain flow, Flow-T, Gaussian SAC         --policy gated / plain / decoded / gaussian --total-steps 12000
     Flow-G, plain flow at a steep init               + --velocity-gain 6
   Score: the deterministic evaluation return on 32 seeded episodes, 0 = uniform random, 100 = a PD controller;
   score_auc is the mean over the evaluations (every 4k steps: 4k, 8k, 12k) after step 0.

Paired re-plan (benchmarks/claims_plan.csv; seeds 0-2 are its pilot): Flow-G > plain flow in score_auc (K 8, default
init) is a paired t test on the per-seed differences of
`--part sac --arms Flow-G "plain flow" --seeds 20 21 22 23 24 25 26 27`.

Writes benchmarks/results/flow_sac.csv (rows through benchmarks/_results.py), flow_sac.md and flow_sac.png.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "flow_sac.csv", "flow_sac"
RUNS = ROOT / "runs" / "bench_flow_sac"
KINDS = {"plain": "plain flow", "gated": "Flow-G", "decoded": "Flow-T"}
KS, GAINS, GRAD_SEEDS = (1, 2, 4, 8, 16, 32), (1.0, 6.0), tuple(range(16))
STEPS, STEEP = {"total_steps": 12000}, {"velocity_gain": 6.0}
ARMS = {"Flow-G": {"policy": "gated", **STEPS}, "plain flow": {"policy": "plain", **STEPS},
        "Flow-T": {"policy": "decoded", **STEPS}, "Gaussian SAC": {"policy": "gaussian", **STEPS},
        "Flow-G, gain 6": {"policy": "gated", **STEPS, **STEEP},
        "plain flow, gain 6": {"policy": "plain", **STEPS, **STEEP}}
SEEDS = (0, 1, 2)


def flags_of(kw: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                    for k, v in kw.items())


def grad_config(kind: str, gain: float, K: int) -> str:
    return f"grad | {KINDS[kind]} | gain {gain:g} | K {K}"


def run_grads(seeds) -> None:
    from algos import flow_sac as fs

    for seed in seeds:
        for gain in GAINS:
            tab = fs.grad_norm_table(tuple(KINDS), KS, gain, seed=seed)
            for (kind, K), (jac, g) in tab.items():
                m = {"jac_a0": jac, "grad_theta": g, "log10_jac_a0": math.log10(jac), "log10_grad_theta": math.log10(g)}
                append_rows(CSV, "flow_sac_grad", "algos/flow_sac.py", grad_config(kind, gain, K), seed, m,
                            f"python benchmarks/flow_sac_table.py (grad_norm_table gain {gain:g}, seed {seed})")


def out_dir(label: str, seed: int) -> Path:
    return RUNS / f"s{seed}" / label.replace(" ", "_").replace(",", "")


def one_run(job: tuple[str, int]) -> dict:
    """One SAC run (a worker process of the pool): the arm's flags on the script defaults, one thread."""
    from algos import flow_sac as fs

    label, seed = job
    shutil.rmtree(out_dir(label, seed), ignore_errors=True)  # the tracker appends to metrics.jsonl
    return fs.main(fs.Args(seed=seed, threads=1, out_dir=str(out_dir(label, seed)), **ARMS[label]))


def run_sac(seeds, jobs: int, arms=tuple(ARMS)) -> None:
    """Every (seed, arm) run, `jobs` at a time in separate processes; the rows are written here, in order."""
    import multiprocessing as mp

    todo = [(label, seed) for seed in seeds for label in arms]
    with mp.get_context("spawn").Pool(jobs) as pool:
        for (label, seed), s in zip(todo, pool.imap(one_run, todo)):
            cmd = f"python algos/flow_sac.py {flags_of(ARMS[label])} --threads 1 --seed {seed}"
            append_rows(CSV, "flow_sac_train", "algos/flow_sac.py", f"train | {label}", seed, s, cmd)
            print(f"{label} seed {seed}: score {s['score_first']:.1f} -> {s['score_last']:.1f}", flush=True)


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    f = mean_std
    lines = []
    norms = (("log10_jac_a0", "log10 ‖d a_K / d a_0‖"), ("log10_grad_theta", "log10 ‖d a_K / d theta‖"))
    for metric, what in norms:
        lines += [f"| {what} | gain | " + " | ".join(f"K = {K}" for K in KS) + " | seeds |",
                  "|---|---|" + "---|" * len(KS) + "---|"]
        for gain in GAINS:
            for kind, name in KINDS.items():
                cells = [[r[metric] for r in by.get(grad_config(kind, gain, K), {}).values()] for K in KS]
                if any(cells):
                    lines.append(f"| {name} | {gain:g} | " + " | ".join(f(c, 1, 2) for c in cells) +
                                 f" | {len(cells[0])} |")
        lines.append("")
    lines += ["| arm | score start | score, mean over evals | score end | best | return end | max actor grad norm | "
              "trained ‖d a_K / d a_0‖ | trained ‖d a_K / d theta‖ | wall s | seeds |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = list(by.get(f"train | {label}", {}).values())
        if not runs:
            continue
        g = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        lines.append(f"| {label} | {f(g('score_first'))} | {f(g('score_auc'))} | {f(g('score_last'))} | "
                     f"{f(g('score_best'))} | {f(g('return_last'), 1, 2)} | {f(g('actor_grad_norm_max'), 1, 2)} | "
                     f"{f(g('jac_a0_end'), 1, 3)} | {f(g('grad_theta_end'), 1, 2)} | {f(g('wall_s'), 1, 0)} | "
                     f"{len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", "Gradient tables: freshly initialised velocities (hidden 64, 2 x SiLU), 64 states of the point-mass "
              "task, a_0 ~ N(0, I), the deterministic flow a_{k+1} = a_k + v / K; each cell the mean ± std over init "
              "seeds of log10 of the norm (0 is 1, 3 is 1,000). Score table: SAC on a 2-D point mass reaching a "
              "random goal (30 steps, reward -distance), 0 = uniform random actions, 100 = a PD controller, on 32 "
              "seeded evaluation episodes with the deterministic policy; each arm's flags on the script defaults "
              "(K = 8, 8 environments, 1 update per vector step, batch 256) and 12k environment steps. "
              f"Hardware: {row['hardware']} (shared with other jobs; one thread per run); {row['versions']}; commit "
              f"{row['commit']}. Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/flow_sac_table.py`."]
    lines += verdicts(by)
    if plot(by) or (RESULTS / f"{NAME}.png").exists():
        lines += ["", "![gradient norm through K flow steps, and score during SAC training](results/flow_sac.png)"]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def verdicts(by) -> list[str]:
    """The paper's claims against these rows, each comparison alone: the difference of the seed means, its Welch 95%
    interval and where it lies (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    import statistics as st

    from benchmarks.report import describe_comparison

    def fig(config, key):
        vals = [r[key] for r in by.get(config, {}).values() if key in r]
        return (st.mean(vals), st.stdev(vals) if len(vals) > 1 else 0.0, len(vals)) if vals else (math.nan, 0, 1)

    def says(a, b, digits=1):
        return describe_comparison("0>1", [a, b], digits)

    jac = {k: fig(grad_config(k, 6.0, 32), "log10_jac_a0") for k in KINDS}
    auc = {a: fig(f"train | {a}", "score_auc") for a in ARMS}
    end = {a: fig(f"train | {a}", "score_last") for a in ARMS}
    return ["", "Paper claims, each comparison on this table's seeds alone (the first arm minus the second; the "
            "claims table gives the verdicts): the plain "
            "velocity's gradient explodes where the gated one's stays bounded (log10 ‖d a_K / d a_0‖ at K = 32, "
            f"gain 6): {says(jac['plain'], jac['gated'], 2)} ({jac['plain'][0]:.2f} vs {jac['gated'][0]:.2f}); "
            f"and the decoded one's: {says(jac['plain'], jac['decoded'], 2)} ({jac['decoded'][0]:.2f}); "
            f"Flow-G trains better than the plain flow (mean score over training, default init): "
            f"{says(auc['Flow-G'], auc['plain flow'])} ({auc['Flow-G'][0]:.1f} vs {auc['plain flow'][0]:.1f}); "
            f"Flow-T better than the plain flow: {says(auc['Flow-T'], auc['plain flow'])} "
            f"({auc['Flow-T'][0]:.1f}); at a steep init (gain 6), final score Flow-G > plain flow: "
            f"{says(end['Flow-G, gain 6'], end['plain flow, gain 6'])} ({end['Flow-G, gain 6'][0]:.1f} vs "
            f"{end['plain flow, gain 6'][0]:.1f}); Flow-G better than Gaussian SAC (mean score over training): "
            f"{says(auc['Flow-G'], auc['Gaussian SAC'])} ({auc['Flow-G'][0]:.1f} vs {auc['Gaussian SAC'][0]:.1f})."]


def plot(by) -> bool:
    """Left: mean log10 ||d a_K / d a_0|| against K per velocity and gain. Right: the mean evaluation score over seeds
    against environment steps per SAC arm, from the runs' metrics.jsonl (kept under runs/; without them a committed
    PNG stays as it is)."""
    import statistics as st

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    drew = curves = False
    for kind, name in KINDS.items():
        for gain, style in zip(GAINS, ("--", "-")):
            ys = [[r["log10_jac_a0"] for r in by.get(grad_config(kind, gain, K), {}).values()] for K in KS]
            if all(ys):
                axes[0].plot(KS, [st.mean(y) for y in ys], style, marker="o", ms=3, label=f"{name}, gain {gain:g}")
                drew = True
    axes[0].set(xscale="log", xlabel="flow steps K", ylabel="log10 ||d a_K / d a_0|| (mean over seeds)",
                title="gradient through the flow rollout")
    axes[0].set_xticks(KS, [str(k) for k in KS])
    axes[0].legend(fontsize=7)
    for label in ARMS:
        per_seed = []
        for path in sorted(RUNS.glob(f"s*/{out_dir(label, 0).name}/metrics.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            per_seed.append([(r["step"], r["eval/score"]) for r in rows if "eval/score" in r])
        if per_seed and all(len(p) == len(per_seed[0]) for p in per_seed):
            pts = [(p[0][0], st.mean(q[1] for q in p)) for p in zip(*per_seed)]
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "--" if "gain 6" in label else "-", marker="o",
                         ms=3, label=label)
            curves = True
    axes[1].set(xlabel="environment steps", ylabel="eval score (mean over seeds)", title="SAC on the point mass")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    keep = (RESULTS / f"{NAME}.png").exists() and not curves  # without runs/ the committed plot stays
    if drew and not keep:
        fig.savefig(RESULTS / f"{NAME}.png", dpi=90)
    plt.close(fig)
    return drew and not keep


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--part", choices=("all", "grads", "sac"), default="all",
                    help="grads: only the gradient table (seconds); sac: only the SAC runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="SAC seeds")
    ap.add_argument("--jobs", type=int, default=1, help="SAC runs at a time (one thread each)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="SAC arms to run")
    a = ap.parse_args()
    if not a.report_only:
        if a.part in ("all", "grads"):
            run_grads(GRAD_SEEDS)
        if a.part in ("all", "sac"):
            run_sac(a.seeds, a.jobs, a.arms)
    report()
