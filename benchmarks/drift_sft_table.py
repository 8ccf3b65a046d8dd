"""DRIFT against GRPO and rejection-sampling SFT: held-out accuracy against generated tokens.

    python benchmarks/drift_sft_table.py                 # 5 arms x 3 seeds, one thread each (~8 CPU minutes)
    python benchmarks/drift_sft_table.py --only GRPO --seeds 0   # some runs
    python benchmarks/drift_sft_table.py --report-only   # rebuilds the table and the plot from the CSV

The claim ("DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn Optimization",
arXiv:2605.31455): sampling once from a fixed reference policy and fine-tuning on the samples weighted by
exp(R / beta) "matches or exceeds" online RL "while maintaining the training efficiency and simplicity of standard
supervised fine-tuning", where plain offline SFT "suffers from distribution shift and behavioral collapse".

Arms, all from tiny-0.6m on `add` (2-digit addition), lr 1e-4, one thread:
  GRPO          algos/grpo.py, 32 prompts x 8 per step, 16 steps = 4,096 sampled sequences, evaluated every 4 steps
                (1,024 sequences): the accuracy curve against generated tokens
  DRIFT N=...   algos/drift_sft.py: N prompts x 8 reference samples once (N = 128: 1,024 sequences; N = 512: 4,096),
                beta 0.5, weights self-normalised over the set, 200 steps of 64 samples
  RS-SFT N=...  the same samples and steps with --weighting rejection (only the verified samples, uniform weights)
The DRIFT and RS-SFT arms of one N train on the same reference samples (the same seed draws them): they differ in the
weights only. GRPO and DRIFT differ in more than the weights (online against offline samples, 16 updates of 256
sequences against 200 of 64): that difference is the paper's claim, at equal generated tokens; the trained sequences
are reported beside it.
Plan, fixed before the runs: metric = held-out greedy accuracy at the end (500 prompts); rows: DRIFT N=512 above GRPO
at 4,096 sequences, and DRIFT N=512 above RS-SFT N=512 (each 0>1, effect 2.6 points, as the other accuracy rows of the
claims table); 3 seeds per arm (the ~10-minute budget; at the spreads of the equal-budget GRPO family table, 2.8 and
1.3 points, 80% power would need 13); verdicts by benchmarks/report.py's rule.

Writes benchmarks/results/drift_sft.csv, drift_sft.md and drift_sft.png.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "drift_sft.csv", "drift_sft"
SEEDS = (0, 1, 2)
GROUP, PROMPTS_PER_STEP, GRPO_STEPS, GRPO_EVAL = 8, 32, 16, 4
SIZES = (128, 512)
ARMS = ["GRPO"] + [f"{w} N={n}" for n in SIZES for w in ("DRIFT", "RS-SFT")]
COMMON = dict(eval_examples=500, eval_hard=False, pass_k=0, threads=1)
DRIFT_FLAGS = dict(steps=200, batch_size=64, beta=0.5)


def run_grpo(seed: int) -> None:
    from algos import grpo

    out = Path(f"runs/bench_drift_sft/s{seed}")
    s = grpo.main(grpo.Args(prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP, steps=GRPO_STEPS, eval_every=GRPO_EVAL,
                            seed=seed, out_dir=str(out), exp_name="grpo", **COMMON))
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    tokens, curve = 0.0, {}
    for r in rows:
        tokens += r.get("rollout/length", 0.0) * PROMPTS_PER_STEP * GROUP
        if "eval/acc" in r and r["step"] > 0:
            n = r["step"] * PROMPTS_PER_STEP * GROUP
            curve.update({f"acc_at_{n}seq": r["eval/acc"], f"gen_tokens_at_{n}seq": tokens})
    figures = {**s, **curve, "sequences": GRPO_STEPS * PROMPTS_PER_STEP * GROUP,
               "trained_sequences": GRPO_STEPS * PROMPTS_PER_STEP * GROUP}
    append_rows(CSV, NAME, "algos/grpo.py", "GRPO", seed, {k: v for k, v in figures.items() if _finite(v)},
                f"python algos/grpo.py --prompts-per-step {PROMPTS_PER_STEP} --group-size {GROUP} --steps {GRPO_STEPS} "
                f"--eval-every {GRPO_EVAL} --eval-examples 500 --no-eval-hard --pass-k 0 --threads 1 --seed {seed}")


def run_drift(label: str, seed: int) -> None:
    from algos import drift_sft

    weighting, n = ("rejection" if label.startswith("RS") else "drift"), int(label.split("N=")[1])
    s = drift_sft.main(drift_sft.Args(prompts=n, group_size=GROUP, weighting=weighting, seed=seed,
                                      eval_every=DRIFT_FLAGS["steps"], out_dir=f"runs/bench_drift_sft/s{seed}",
                                      exp_name=f"{weighting}_n{n}", **DRIFT_FLAGS, **COMMON))
    figures = {**s, "sequences": n * GROUP, "trained_sequences": DRIFT_FLAGS["steps"] * DRIFT_FLAGS["batch_size"]}
    append_rows(CSV, NAME, "algos/drift_sft.py", label, seed, {k: v for k, v in figures.items() if _finite(v)},
                f"python algos/drift_sft.py --prompts {n} --group-size {GROUP} --weighting {weighting} --beta 0.5 "
                f"--steps 200 --batch-size 64 --eval-every 200 --eval-examples 500 --no-eval-hard --pass-k 0 "
                f"--threads 1 --seed {seed}")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def report() -> None:
    by, meta = by_config_seed(CSV)
    fmt = lambda vals, scale=100.0, digits=1: mean_std(vals, scale, digits, bare_single=False)  # noqa: E731
    lines = ["| arm | sampled sequences | generated tokens | trained sequences | held-out acc start | end | "
             "reference reward | kept | effective sample size | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = list(by.get(label, {}).values())
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        drift = label != "GRPO"
        extra = [fmt(get(k)) if drift else "-" for k in ("train_reward_first", "kept_frac", "ess_frac")]
        lines.append(f"| {label} | {fmt(get('sequences'), 1, 0)} | {fmt(get('gen_tokens'), 1, 0)} | "
                     f"{fmt(get('trained_sequences'), 1, 0)} | {fmt(get('eval_acc_start'))} | "
                     f"{fmt(get('eval_acc_end'))} | {' | '.join(extra)} | {fmt(get('wall_s'), 1, 0)} | {len(runs)} |")
    grpo = list(by.get("GRPO", {}).values())
    if grpo:
        points = [n * PROMPTS_PER_STEP * GROUP for n in range(GRPO_EVAL, GRPO_STEPS + 1, GRPO_EVAL)]
        curve = "; ".join(f"{n:,} sequences ({fmt([r[f'gen_tokens_at_{n}seq'] for r in grpo], 1, 0)} tokens): "
                          f"{fmt([r[f'acc_at_{n}seq'] for r in grpo])}" for n in points)
        lines += ["", f"GRPO's held-out accuracy along its run: {curve}."]
    if meta:
        row = next(iter(meta.values()))
        lines += ["", "Held-out greedy accuracy in % on 500 prompts of `add` (mean ± std over seeds), tiny-0.6m, lr "
                  "1e-4, one thread. Sampled sequences are the rollouts each arm generates (DRIFT and RS-SFT once, "
                  "before training, from the shipped policy; GRPO during training); trained sequences are those the "
                  "optimiser steps process. Reference reward: the verified fraction of DRIFT's samples; kept: the "
                  "samples with a positive weight; effective sample size: (sum w)^2 / sum w^2 as a fraction of the "
                  f"samples. beta 0.5. Hardware: {row['hardware']} (shared); {row['versions']}; commit "
                  f"{row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                  "`python benchmarks/drift_sft_table.py`.",
                  "", "![accuracy against generated tokens](results/drift_sft.png)"]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    grpo = list(by.get("GRPO", {}).values())
    if grpo:
        points = [n * PROMPTS_PER_STEP * GROUP for n in range(GRPO_EVAL, GRPO_STEPS + 1, GRPO_EVAL)]
        xs = [0.0] + [statistics.mean(r[f"gen_tokens_at_{n}seq"] for r in grpo) for n in points]
        ys = [statistics.mean(r["eval_acc_start"] for r in grpo)] + \
             [statistics.mean(r[f"acc_at_{n}seq"] for r in grpo) for n in points]
        ax.plot(xs, [100 * y for y in ys], "o-", label="GRPO (online)")
    for name, style in (("DRIFT", "s"), ("RS-SFT", "^")):
        pts = [(statistics.mean(r["gen_tokens"] for r in runs), statistics.mean(r["eval_acc_end"] for r in runs))
               for n in SIZES if (runs := list(by.get(f"{name} N={n}", {}).values()))]
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style + "--", label=f"{name} (samples once)")
    ax.set(xlabel="generated tokens", ylabel="held-out accuracy (%)", title="2-digit addition, tiny-0.6m")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table and the plot from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--only", nargs="+", default=ARMS, choices=ARMS, help="arms to run")
    a = ap.parse_args()
    if not a.report_only:
        for seed in a.seeds:
            for label in a.only:
                run_grpo(seed) if label == "GRPO" else run_drift(label, seed)
    report()
