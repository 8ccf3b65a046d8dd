"""FFDC: model calls and success of fixed short / long chunks vs verifier-gated chunks, across perturbation rates.

Runs `worldmodels/ffdc.py`'s `main(Args(...))` over seeds (default 0 1 2) for the default (Mixture-of-Horizon
training) and for the same WAM trained on single steps (`--horizons 1`), appends every summary figure to
benchmarks/results/ffdc.csv (with provenance, through benchmarks/_results.py), and writes
benchmarks/results/ffdc.md (the block `results:ffdc` of benchmarks/README.md) and benchmarks/results/ffdc.png.

    python benchmarks/ffdc_table.py                  # both configurations, 3 seeds: about 20 min at 1 thread
    python benchmarks/ffdc_table.py --only ffdc      # one configuration
    python benchmarks/ffdc_table.py --report-only    # rebuild the .md and .png from the CSV

Every execution mode of one seed runs on the same 200 maps with the same perturbation draws (common random
numbers); the seeds differ in training data, initialisation, test maps and draws. Modes: 2-step and 8-step chunks;
8-step chunks gated by the learned frame verifier (the predicted frame against the observed one), by a fixed pixel
threshold, or by the learned rollout verifier (whether the rest of the predicted rollout can still be trusted, the
paper's question); and the same-cost baseline, 2 of 8 predicted steps (each call costs what a gated call costs).
Work is counted, not timed: model calls, imagined steps (a policy and a dynamics evaluation each), verifier
evaluations and the multiply-accumulates of all of them, per episode; execution seconds describe only.
Plan, fixed before the runs (3 seeds per configuration; benchmarks/report.py's verdict rule): at perturbation rate
0.1, model calls gated < 2-step chunks, for each learned verifier; imagined steps gated < the same-cost baseline;
multiply-accumulates gated (frame verifier) < 2-step chunks; success gated > 2-step chunks for each learned verifier.
Paired re-plan (benchmarks/claims_plan.csv; the fresh run of seeds 10-17 is its pilot): success gated > 2-step chunks
at rate 0.1 (both execution rules on the same world model, policy and episodes of a seed) is a paired t test on the
per-seed differences of `--only ffdc --seeds 20 21 22 23 24 25 26 27 28`. Paired re-plan of Mixture-of-Horizon
Training (the fresh run of seeds 10-19 is its pilot): frame off at the eighth step, mixture < single steps (both
configurations of a seed train on the same expert trajectories and meet the same test maps), a paired t test on the
per-seed differences of `--seeds $(seq 300 345)`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks._results import RESULTS, fresh_run_tables, mean_std, read_rows, split_runs

CSV, MD, PNG = "ffdc.csv", RESULTS / "ffdc.md", RESULTS / "ffdc.png"
CONFIGS = {
    "ffdc": (dict(), "python worldmodels/ffdc.py"),
    "ffdc-single-horizon": (dict(horizons=(1,)), "python worldmodels/ffdc.py --horizons 1"),
}
MODES = ("short", "long", "gated", "gated-fixed", "gated-rollout", "short-of-long")
LABEL = {"short": "2-step chunks", "long": "8-step chunks", "gated": "gated, frame verifier",
         "gated-fixed": "gated, fixed threshold", "gated-rollout": "gated, rollout verifier",
         "short-of-long": "2 of 8 predicted steps"}
PLAN_RUNS = ((10, 19), (20, 28), (300, 345))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
WORK = ("short", "short-of-long", "long", "gated", "gated-rollout")  # the modes of the counted-work table


def run(names: list[str], seeds: list[int], out_root: Path) -> None:
    import torch

    from benchmarks._results import append_rows
    from worldmodels import ffdc

    torch.set_num_threads(1)
    for seed in seeds:
        for name in names:
            kw, cmd = CONFIGS[name]
            out = out_root / f"{name}_s{seed}"
            summary = ffdc.main(ffdc.Args(seed=seed, out_dir=str(out), exp_name=f"{name}_s{seed}", **kw))
            append_rows(CSV, "ffdc", name, json.dumps(kw, sort_keys=True), seed, summary, command=f"{cmd} --seed {seed}")
            print(f"{name} seed {seed}: " + ", ".join(f"{k}={v:.3g}" for k, v in summary.items()
                                                       if k.startswith("gated_r") and k.endswith("_calls")), flush=True)


def rates_of(seeds: dict) -> list[str]:
    any_seed = next(iter(seeds.values()))
    return sorted({k[len("short_r"):-len("_calls")] for k in any_seed if k.startswith("short_r") and k.endswith("_calls")},
                  key=float)


def vals(seeds: dict, key: str) -> list[float]:
    return [m[key] for m in seeds.values() if key in m]


def welch(a: list[float], b: list[float]) -> str:
    """mean(a) - mean(b) with Welch's 95% interval (benchmarks/report.py's rule)."""
    from benchmarks.report import welch_interval

    if min(len(a), len(b)) < 2:
        return "-"
    m = lambda v: (float(np.mean(v)), float(np.std(v, ddof=1)), len(v))  # noqa: E731
    lo, hi = welch_interval(m(a), m(b))
    return f"{np.mean(a) - np.mean(b):+.2f} [{lo:+.2f}, {hi:+.2f}]"


def by_script() -> tuple[dict, dict]:
    """script -> seed -> metric -> value (a later row wins) and script -> its last row (provenance)."""
    by, meta = {}, {}
    for r in read_rows(CSV):
        by.setdefault(r["script"], {}).setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        meta[r["script"]] = r
    return by, meta


def mode_tables(d: dict, rates: list[str], n: int) -> list[str]:
    """Model calls and success per mode and rate, then each gated arm against 2-step chunks."""
    ms = lambda key, digits=2: mean_std(vals(d, key), digits=digits)  # noqa: E731
    modes = [m for m in MODES if f"{m}_r{rates[0]}_calls" in next(iter(d.values()))]
    lines = [f"`python worldmodels/ffdc.py`, mean ± std over {n} seeds (sample std), 200 test episodes per seed, mode "
             "and perturbation rate; an episode succeeds when the agent reaches the goal within its initial distance "
             "+ 2 steps. At each step, with the given probability, the agent slips (a random other move replaces "
             "the commanded one) or the goal moves to a free neighbouring cell, half the time each. Model calls = "
             "chunk predictions (the paper's WAM forward passes); a call here rolls the WAM out step by step for the "
             "whole predicted chunk, so its cost grows with the chunk length (see the counted work below).", ""]
    for what in ("calls", "success"):
        lines += [f"| {what} per episode, by perturbation rate | " + " | ".join(LABEL[m] for m in modes) + " |",
                  "|---" * (len(modes) + 1) + "|"]
        lines += [f"| {r} | " + " | ".join(ms(f"{m}_r{r}_{what}") for m in modes) + " |" for r in rates] + [""]
    lines += ["Gated execution against 2-step chunks, difference of seed means with Welch's 95% interval:", "",
              "| perturbation rate | verifier | calls, gated - short | calls saved | success, gated - short | early "
              "replans per episode | steps per call |", "|---|---|---|---|---|---|---|"]
    for r in rates:
        for m in [m for m in ("gated", "gated-rollout", "gated-fixed") if m in modes]:
            g, sh = vals(d, f"{m}_r{r}_calls"), vals(d, f"short_r{r}_calls")
            spc = [st / c for st, c in zip(vals(d, f"{m}_r{r}_steps"), g)]
            saved = 100 * (1 - np.mean(g) / np.mean(sh))
            lines.append(f"| {r} | {LABEL[m].split(', ')[1]} | {welch(g, sh)} | {saved:.0f}% | "
                         f"{welch(vals(d, f'{m}_r{r}_success'), vals(d, f'short_r{r}_success'))} | "
                         f"{ms(f'{m}_r{r}_early')} | {mean_std(spc, digits=1)} |")
    return lines


def work_table(d: dict, rates: list[str]) -> list[str]:
    """What each mode costs per episode: imagined steps, verifier evaluations, multiply-accumulates (counted)."""
    ms = lambda key, scale=1.0, digits=1: mean_std(vals(d, key), scale, digits)  # noqa: E731
    modes = [m for m in WORK if f"{m}_r{rates[0]}_macs" in next(iter(d.values()))]
    if not modes:
        return []
    lines = ["", "Counted work per episode (imagined steps: one policy and one dynamics evaluation each; verifier "
             "evaluations: steps the verifier was asked; multiply-accumulates of all of them, in millions, from "
             "the networks' layer shapes). Execution seconds on the shared CPU describe only.", "",
             "| perturbation rate | mode | model calls | imagined steps | verifier evaluations | MACs (M) | "
             "execution s (200 episodes) |", "|---|---|---|---|---|---|---|"]
    for r in rates:
        lines += [f"| {r} | {LABEL[m]} | {ms(f'{m}_r{r}_calls', digits=2)} | {ms(f'{m}_r{r}_evals')} | "
                  f"{ms(f'{m}_r{r}_verifier_evals')} | {ms(f'{m}_r{r}_macs', 1e-6, 2)} | "
                  f"{ms(f'{m}_r{r}_exec_s', digits=2)} |"
                  for m in modes]
    return lines


def verifier_text(d: dict, by: dict, rates: list[str]) -> list[str]:
    ms = lambda key, digits=2: mean_std(vals(d, key), digits=digits)  # noqa: E731
    lines = ["", "The verifiers on held-out steps of perturbed 8-step chunks (rate 0.2). A step is *deviated* when the "
             "predicted frame shows the agent or the goal elsewhere than the observed one "
             f"({ms('verifier_deviated_frac')} "
             f"of steps): frame verifier recall {ms('verifier_learned_recall', 3)}, false alarms "
             f"{ms('verifier_learned_false_alarm', 3)}; fixed threshold (pixel MSE > 1/300) recall "
             f"{ms('verifier_fixed_recall', 3)}, false alarms {ms('verifier_fixed_false_alarm', 3)}. The rest of the "
             "chunk *can no longer be trusted* when executing its remaining actions from the real state (true "
             "dynamics) would show a deviated frame at some later step"]
    if vals(d, "rest_deviated_frac"):
        lines[-1] += (f" ({ms('rest_deviated_frac')} of the steps that have a rest): rollout verifier recall "
                      f"{ms('verifier_rollout_rest_recall', 3)}, false alarms "
                      f"{ms('verifier_rollout_rest_false_alarm', 3)}; the frame verifier on the same labels "
                      f"{ms('verifier_learned_rest_recall', 3)} / {ms('verifier_learned_rest_false_alarm', 3)}.")
    else:
        lines[-1] += " (not measured in these rows)."
    lines[-1] += (f" Without perturbation the WAM's imagined frame is off at the first step of a chunk in "
                  f"{ms('pred_dev_h1', 3)} of chunks and at the eighth in {ms('pred_dev_h8', 3)}.")
    if "ffdc-single-horizon" in by:
        e = by["ffdc-single-horizon"]
        me = lambda key, digits=2: mean_std(vals(e, key), digits=digits)  # noqa: E731
        seeds = f"{len(e)} seed" + ("s" if len(e) > 1 else "")
        lines += ["", f"Mixture-of-Horizon Training (windows of 1, 2, 4 and 8 steps in every batch, the default) against "
                  f"the same WAM trained on single steps (`--horizons 1`, {seeds}): imagined frame off at the "
                  f"eighth chunk step without perturbation {ms('pred_dev_h8', 3)} vs {me('pred_dev_h8', 3)}; gated "
                  "execution (frame verifier), model calls per episode at rate " + ", ".join(
                      f"{r}: {ms(f'gated_r{r}_calls')} vs {me(f'gated_r{r}_calls')}" for r in rates)
                  + "; success " + ", ".join(f"{r}: {ms(f'gated_r{r}_success')} vs {me(f'gated_r{r}_success')}"
                                              for r in rates) + "."]
    return lines


def report() -> None:
    by, meta = by_script()
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    if "ffdc" not in by:
        raise SystemExit(f"no rows in {RESULTS / CSV}: run the benchmark first")
    d = by["ffdc"]
    rates = rates_of(d)
    lines = mode_tables(d, rates, len(d)) + work_table(d, rates) + verifier_text(d, by, rates)
    rows = list(meta.values())
    commits = ", ".join(f"`{c}`" for c in sorted({r["commit"] for r in rows}))
    lines += ["", f"Commits {commits}; {rows[0]['hardware']}, {rows[0]['versions']}; rows in "
              "`benchmarks/results/ffdc.csv`; plot `benchmarks/results/ffdc.png`."]
    # the plan's comparisons are at perturbation rate 0.1: a column per mode and figure, a row per configuration
    cols = [(f"{what} at 0.1, {LABEL[m]}", f"{m}_r0.1_{what}", 1, 2) for what in ("calls", "success")
            for m in ("short", "gated", "gated-rollout")] + [("frame off at the 8th step", "pred_dev_h8", 1, 3)]
    lines += fresh_run_tables(parts[1:], cols, CONFIGS)
    MD.write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [float(r) for r in rates]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in [m for m in MODES if vals(d, f"{m}_r{rates[0]}_calls")]:
        for ax, key in zip(axes, ("calls", "success")):
            v = np.array([vals(d, f"{m}_r{r}_{key}") for r in rates])  # (rates, seeds)
            ax.errorbar(x, v.mean(1), yerr=v.std(1, ddof=1) if v.shape[1] > 1 else None, marker="o", capsize=3,
                        label=LABEL[m])
    axes[0].set_ylabel("model calls per episode"), axes[1].set_ylabel("success rate")
    for ax in axes:
        ax.set_xlabel("perturbation probability per step"), ax.legend(fontsize=7)
    fig.suptitle(f"FFDC on the gridworld: fixed vs verifier-gated chunks (mean ± std, {len(d)} seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)
    plt.close(fig)
    print(f"wrote {MD.relative_to(ROOT)} and {PNG.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", default=None, help="configurations to run (default: all)")
    ap.add_argument("--out-root", default="runs/ffdc_table", help="run directories")
    ap.add_argument("--report-only", action="store_true", help="rebuild the .md and .png from the CSV")
    args = ap.parse_args()
    names = list(CONFIGS) if args.only is None else args.only
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    if not args.report_only:
        run(names, args.seeds, Path(args.out_root))
    report()


if __name__ == "__main__":
    main()
