"""MC-GRPO: how often a mean or a median group baseline gives a rollout the wrong advantage sign, at G = 2, 4, 8.

    python benchmarks/mc_grpo_table.py                  # the sign-flip simulation (seconds) + the table and plot
    python benchmarks/mc_grpo_table.py --train          # also the training comparison (3 seeds x 6 runs, minutes)
    python benchmarks/mc_grpo_table.py --train-only --train-arms "G=2 mean, no std" --train-seeds 2  # some runs
    python benchmarks/mc_grpo_table.py --report-only    # rebuilds the table and the plot from the CSVs

The claim ("MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout
Reinforcement Learning", arXiv:2601.22582): with few rollouts the mean baseline is noisy and flips the sign of
some advantages; a median over G+1 rollouts (the pivot dropped) flips fewer, and the accuracy gap between G=2
and G=8 shrinks (to within 1% in the paper).

Sign flips (pure simulation, algos/mc_grpo.py's sign_flip_counts on the advantage functions the script trains
with): each prompt has a true success rate p ~ U(0, 1); a response has a true value v = E[r | response] and the
prompt E[r | prompt] = p; the true advantage sign is sign(v - p). Reward models:
  binary           v ~ Bernoulli(p), r = v (a mean that includes the sample itself cannot flip a sign here)
  binary + noise   r = v + N(0, 0.3^2) (a noisy verifier or reward model)
  graded           v = Binomial(4, p) / 4 (partial credit over 4 steps), r = v
  graded + noise   r = v + N(0, 0.2^2)
Arms: mean over G rollouts (GRPO); median over G+1 with the pivot not counted (MC-GRPO, same G samples carry
gradient); mean over G+1 (one more rollout, all carrying gradient: does the extra sample alone explain it?).
Two kinds of flip: a baseline flip, sign(r_i - baseline) = -sign(r_i - p) (the estimated baseline against the
true expected reward, for the same observed reward: the flips the paper attributes to baseline noise); and a
value flip, sign(r_i - baseline) = -sign(v_i - p) (against the response's true worth: reward noise counts too).
A zero: A_i = 0 while v_i != p (the sample carries no gradient).

Training (--train): algos/mc_grpo.py on `add` with --reward-noise 0.3, G = 2 and 8, median vs mean baseline,
the same prompts per step and steps, 3 seeds. The G = 2 mean arm (GRPO) differs from the median arm in more than
the baseline: it divides by the group std (at G = 2 every non-zero advantage becomes +-0.707, whatever the reward
gap) and samples 2 rollouts per prompt against the median arm's 3. Two control arms take these apart: the mean
baseline without std normalisation at G = 2 (--no-adv-std-norm, as the median arm has no MAD normalisation), and
the mean over 3 rollouts without it (the median arm's sampling cost; all 3 carry gradient).

Writes benchmarks/results/mc_grpo_signflip.csv, mc_grpo.csv (training), mc_grpo.md and mc_grpo.png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std, seed_ranges  # noqa: E402

FLIP_CSV, TRAIN_CSV, NAME = "mc_grpo_signflip.csv", "mc_grpo.csv", "mc_grpo"
GROUPS = (2, 4, 8)
SEEDS = (0, 1, 2)
MODELS = ("binary", "binary + noise", "graded", "graded + noise")
ARMS = ("mean, G", "median, G+1 (pivot dropped)", "mean, G+1")
TRAIN = {"G=2 mean": (2, "mean", {}), "G=2 median": (2, "median", {}), "G=8 mean": (8, "mean", {}),
         "G=8 median": (8, "median", {}), "G=2 mean, no std": (2, "mean", {"adv_std_norm": False}),
         "G=3 mean, no std": (3, "mean", {"adv_std_norm": False})}
TRAIN_FLAGS = dict(reward_noise=0.3, steps=60, prompts_per_step=32, eval_every=30, eval_examples=300, pass_k=0,
                   eval_hard=False, threads=1)


def simulate(model: str, n: int, prompts: int, gen):
    """(rewards [P, n], true values [P, n], prompt values [P]) of one reward model."""
    import torch

    p = torch.rand(prompts, generator=gen)
    if model.startswith("binary"):
        v = (torch.rand(prompts, n, generator=gen) < p[:, None]).float()
    else:
        v = torch.distributions.Binomial(4, p[:, None].expand(prompts, n)).sample() / 4
    noise = {"binary + noise": 0.3, "graded + noise": 0.2}.get(model, 0.0)
    r = v + noise * torch.randn(prompts, n, generator=gen)
    return r, v, p


def run_flips(seeds, prompts: int) -> None:
    import torch

    from algos import mc_grpo

    for seed in seeds:
        for model in MODELS:
            for G in GROUPS:
                torch.manual_seed(seed)  # Binomial.sample draws from the global generator
                gen = torch.Generator().manual_seed(seed * 1000 + G)
                r, v, p = simulate(model, G + 1, prompts, gen)  # G+1 rollouts; the mean arm uses the first G
                for arm in ARMS:
                    cols = slice(0, G) if arm == "mean, G" else slice(0, G + 1)
                    baseline = "median" if "median" in arm else "mean"
                    b = mc_grpo.sign_flip_counts(r[:, cols], r[:, cols], p, baseline)  # true sign: r_i - p
                    c = mc_grpo.sign_flip_counts(r[:, cols], v[:, cols], p, baseline)  # true sign: v_i - p
                    append_rows(FLIP_CSV, "mc_grpo_signflip", "algos/mc_grpo.py", f"{model} | G={G} | {arm}", seed,
                                {"baseline_flip_rate": b["flipped"] / b["counted"],
                                 "value_flip_rate": c["flipped"] / c["counted"], "zero_adv_rate": c["zero"] / c["counted"],
                                 "counted": c["counted"]}, f"python benchmarks/mc_grpo_table.py --prompts {prompts}")


def run_train(seeds, arms) -> None:
    from algos import mc_grpo

    for seed in seeds:
        for label in arms:
            G, baseline, extra = TRAIN[label]
            args = mc_grpo.Args(group_size=G, baseline=baseline, seed=seed, out_dir=f"runs/bench_mc_grpo/s{seed}",
                                exp_name=label.replace(" ", "_").replace("=", "").replace(",", ""), **TRAIN_FLAGS,
                                **extra)
            s = mc_grpo.main(args)
            cmd = (f"python algos/mc_grpo.py --group-size {G} --baseline {baseline} --reward-noise 0.3 --steps 60 "
                   f"--eval-every 30 --eval-examples 300 --pass-k 0 --no-eval-hard --threads 1 --seed {seed}"
                   + (" --no-adv-std-norm" if extra.get("adv_std_norm") is False else ""))
            append_rows(TRAIN_CSV, "mc_grpo_train", "algos/mc_grpo.py", label, seed, s, cmd)


def collect(csv_name: str):
    return by_config_seed(csv_name)


def fmt(vals, scale=100.0, digits=1):
    return mean_std(vals, scale, digits)


def train_table(tby: dict) -> list[str]:
    """The training arms' table from {label: {seed: {metric: value}}}."""
    lines = ["", "| run | held-out acc start | end | best | train reward last | generated tokens | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for label in TRAIN:
        runs = list(tby.get(label, {}).values())
        if runs:
            get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
            lines.append(f"| {label} | {fmt(get('eval_acc_start'))} | {fmt(get('eval_acc_end'))} | "
                         f"{fmt(get('eval_acc_best'))} | {fmt(get('train_reward_last'))} | "
                         f"{fmt(get('gen_tokens'), 1, 0)} | {fmt(get('wall_s'), 1, 0)} | {len(runs)} |")
    return lines


def report() -> None:
    by, meta = collect(FLIP_CSV)
    head = " | ".join(f"{arm}: baseline flips | value flips | zeros" for arm in ARMS)
    lines = [f"| reward | G | {head} |", "|---|---|" + "---|---|---|" * len(ARMS)]
    for model in MODELS:
        for G in GROUPS:
            cells = []
            for arm in ARMS:
                runs = list(by.get(f"{model} | G={G} | {arm}", {}).values())
                cells += [fmt([r["baseline_flip_rate"] for r in runs], digits=2),
                          fmt([r["value_flip_rate"] for r in runs], digits=2),
                          fmt([r["zero_adv_rate"] for r in runs], digits=1)]
            lines.append(f"| {model} | {G} | " + " | ".join(cells) + " |")
    if meta:
        row = next(iter(meta.values()))
        n_seeds = len(next(iter(by.values())))
        ref = by.get(f"binary | G={GROUPS[0]} | {ARMS[0]}", {})
        prompts = int(next(iter(ref.values()))["counted"]) // GROUPS[0] if ref else 0  # the mean arm counts G each
        lines += ["", f"Percent of the rollouts that carry gradient (mean ± std over {n_seeds} seeds of {prompts} simulated "
                  f"prompts; the median arm does not count its pivot). Baseline flips: sign(r_i - baseline) is the opposite of "
                  f"sign(r_i - E[r | prompt]) (the baseline's error alone); value flips: the opposite of "
                  f"sign(E[r | response] - E[r | prompt]) (reward noise included); zeros: advantage 0 while the true "
                  f"sign is not. Prompts: "
                  f"success rate p ~ U(0, 1); binary: r ~ Bernoulli(p); graded: r = Binomial(4, p) / 4; noise: "
                  f"Gaussian, std 0.3 (binary) and 0.2 (graded). See the header of `benchmarks/mc_grpo_table.py`. "
                  f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{FLIP_CSV}`; command: "
                  f"`{row['command']}`.", "", "![sign-flip rates](results/mc_grpo.png)"]
    tby, tmeta = collect(TRAIN_CSV)
    if tby:
        # the table compares the arms on the first run's seeds (those of GRPO at G = 2); seeds beyond them (a claims
        # plan's fresh run of two arms) get a table of their own, so that no comparison mixes seed sets
        first = set(tby.get("G=2 mean", {}))
        fresh = {label: f for label, d in tby.items() if (f := {s: r for s, r in d.items() if s not in first})}
        lines += train_table({label: {s: r for s, r in d.items() if s in first} for label, d in tby.items()})
        gap = {b: [tby[f"G=8 {b}"][s]["eval_acc_end"] - tby[f"G=2 {b}"][s]["eval_acc_end"]
                   for s in tby.get(f"G=8 {b}", {}) if s in tby.get(f"G=2 {b}", {})] for b in ("mean", "median")}
        row = next(iter(tmeta.values()))
        lines += ["", f"Accuracy gap G=8 minus G=2 (points, per seed then mean ± std): mean baseline "
                  f"{fmt(gap['mean'])}, median baseline {fmt(gap['median'])}. `add` (2-digit addition), tiny-0.6m, "
                  f"training reward = exact answer + N(0, 0.3^2), {TRAIN_FLAGS['steps']} rollout batches of "
                  f"{TRAIN_FLAGS['prompts_per_step']} prompts (the median arm samples G+1 per prompt and trains on G; "
                  f"'no std': the mean baseline without dividing by the group std), "
                  f"lr 1e-4, 300 held-out prompts, greedy. Hardware: {row['hardware']} (shared); commit "
                  f"{row['commit']}. Rows: `benchmarks/results/{TRAIN_CSV}`; command: "
                  f"`python benchmarks/mc_grpo_table.py --train`."]
        if fresh:
            seeds = seed_ranges({s for d in fresh.values() for s in d})
            lines += ["", f"Seeds {seeds}, which only these arms ran (a fresh run of the claims plan, "
                      "benchmarks/claims_plan.csv):"] + train_table(fresh)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(3.2 * len(MODELS), 3.2), sharey=True)
    for ax, model in zip(axes, MODELS):
        for arm, style in zip(ARMS, ("o-", "s-", "^:")):
            ys = [statistics.mean(r["baseline_flip_rate"] for r in by.get(f"{model} | G={G} | {arm}", {}).values()) * 100
                  if by.get(f"{model} | G={G} | {arm}") else float("nan") for G in GROUPS]
            ax.plot(GROUPS, ys, style, label=arm)
        ax.set(title=model, xlabel="G (rollouts carrying gradient)", xticks=GROUPS)
    axes[0].set_ylabel("baseline sign flips (% of rollouts)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table and the plot from the CSVs")
    ap.add_argument("--train", action="store_true", help="also run the training comparison (minutes)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--train-seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--train-arms", nargs="+", default=list(TRAIN), choices=list(TRAIN), help="training arms to run")
    ap.add_argument("--prompts", type=int, default=20000, help="simulated prompts per (reward model, G, seed)")
    ap.add_argument("--train-only", action="store_true", help="run the training arms, not the simulation")
    a = ap.parse_args()
    if not a.report_only:
        if not a.train_only:
            run_flips(a.seeds, a.prompts)
        if a.train or a.train_only:
            run_train(a.train_seeds, a.train_arms)
    report()
