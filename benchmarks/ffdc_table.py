"""FFDC: model calls and success of fixed short / long chunks vs verifier-gated chunks, across perturbation rates.

Runs `worldmodels/ffdc.py`'s `main(Args(...))` over seeds (default 0 1 2) for the default (Mixture-of-Horizon
training) and for the same WAM trained on single steps (`--horizons 1`), appends every summary figure to
benchmarks/results/ffdc.csv (with provenance, through benchmarks/_results.py), and writes
benchmarks/results/ffdc.md (the block `results:ffdc` of benchmarks/README.md) and benchmarks/results/ffdc.png.

    python benchmarks/ffdc_table.py                  # both configurations, 3 seeds: about 8 min at 1 thread
    python benchmarks/ffdc_table.py --only ffdc      # one configuration
    python benchmarks/ffdc_table.py --report-only    # rebuild the .md and .png from the CSV

Every execution mode of one seed runs on the same 200 maps with the same perturbation draws (common random
numbers); the seeds differ in training data, initialisation, test maps and draws.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks._results import RESULTS, mean_std, read_rows

CSV, MD, PNG = "ffdc.csv", RESULTS / "ffdc.md", RESULTS / "ffdc.png"
CONFIGS = {
    "ffdc": (dict(), "python worldmodels/ffdc.py"),
    "ffdc-single-horizon": (dict(horizons=(1,)), "python worldmodels/ffdc.py --horizons 1"),
}
MODES = ("short", "long", "gated", "gated-fixed")
LABEL = {"short": "2-step chunks", "long": "8-step chunks", "gated": "gated, learned verifier",
         "gated-fixed": "gated, fixed threshold"}


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


def report() -> None:
    by, meta = by_script()
    if "ffdc" not in by:
        raise SystemExit(f"no rows in {RESULTS / CSV}: run the benchmark first")
    d = by["ffdc"]
    rates = rates_of(d)
    n = len(d)
    ms = lambda key, digits=2: mean_std(vals(d, key), digits=digits)  # noqa: E731
    lines = [f"`python worldmodels/ffdc.py`, mean ± std over {n} seeds (sample std), 200 test episodes per seed, mode "
             "and perturbation rate; an episode succeeds when the agent reaches the goal within its initial distance "
             "+ 2 steps. At each step, with the given probability, the agent slips (a random other move replaces "
             "the commanded one) or the goal moves to a free neighbouring cell, half the time each. Model calls = "
             "chunk predictions (the paper's WAM forward passes); a call here rolls the WAM out for the whole chunk, "
             "so network evaluations grow with the chunk length.", "",
             "| perturbation rate | " + " | ".join(f"calls: {LABEL[m]}" for m in MODES) + " | "
             + " | ".join(f"success: {LABEL[m]}" for m in MODES) + " |", "|---" * (2 * len(MODES) + 1) + "|"]
    for r in rates:
        lines.append(f"| {r} | " + " | ".join(ms(f"{m}_r{r}_calls") for m in MODES) + " | "
                     + " | ".join(ms(f"{m}_r{r}_success") for m in MODES) + " |")
    lines += ["", "Gated execution (learned verifier) against 2-step chunks, difference of seed means with Welch's 95% "
              "interval, and what a call costs:", "",
              "| perturbation rate | calls, gated - short | calls saved | success, gated - short | network evaluations: "
              "short / long / gated | early replans per episode: gated / gated-fixed | steps per call, gated | "
              "execution s, short / gated |", "|---|---|---|---|---|---|---|---|"]
    for r in rates:
        g, s = vals(d, f"gated_r{r}_calls"), vals(d, f"short_r{r}_calls")
        saved = 100 * (1 - np.mean(g) / np.mean(s))
        spc = [st / c for st, c in zip(vals(d, f"gated_r{r}_steps"), g)]
        lines.append(f"| {r} | {welch(g, s)} | {saved:.0f}% | {welch(vals(d, f'gated_r{r}_success'), vals(d, f'short_r{r}_success'))} | "
                     + " / ".join(ms(f"{m}_r{r}_evals", 1) for m in ("short", "long", "gated")) + " | "
                     + " / ".join(ms(f"{m}_r{r}_early") for m in ("gated", "gated-fixed")) + f" | {mean_std(spc, digits=1)} | "
                     + " / ".join(ms(f"{m}_r{r}_exec_s", 2) for m in ("short", "gated")) + " |")
    lines += ["", "The verifiers on held-out steps of perturbed 8-step chunks (rate 0.2; a step is *deviated* when the "
              f"predicted frame shows the agent or the goal elsewhere than the observed one, {ms('verifier_deviated_frac')} "
              f"of them): learned verifier recall {ms('verifier_learned_recall', 3)}, false alarms "
              f"{ms('verifier_learned_false_alarm', 3)}; fixed threshold (pixel MSE > 1/300) recall "
              f"{ms('verifier_fixed_recall', 3)}, false alarms {ms('verifier_fixed_false_alarm', 3)}. Without "
              f"perturbation the WAM's imagined frame is off at the first step of a chunk in {ms('pred_dev_h1', 3)} of "
              f"chunks and at the eighth in {ms('pred_dev_h8', 3)}."]
    if "ffdc-single-horizon" in by:
        e = by["ffdc-single-horizon"]
        me = lambda key, digits=2: mean_std(vals(e, key), digits=digits)  # noqa: E731
        seeds = f"{len(e)} seed" + ("s" if len(e) > 1 else "")
        lines += ["", f"Mixture-of-Horizon Training (windows of 1, 2, 4 and 8 steps in every batch, the default) against "
                  f"the same WAM trained on single steps (`--horizons 1`, {seeds}): imagined frame off at the "
                  f"eighth chunk step without perturbation {ms('pred_dev_h8', 3)} vs {me('pred_dev_h8', 3)}; gated "
                  "execution, model calls per episode at rate " + ", ".join(
                      f"{r}: {ms(f'gated_r{r}_calls')} vs {me(f'gated_r{r}_calls')}" for r in rates)
                  + "; success " + ", ".join(f"{r}: {ms(f'gated_r{r}_success')} vs {me(f'gated_r{r}_success')}"
                                              for r in rates) + "."]
    rows = list(meta.values())
    commits = ", ".join(f"`{c}`" for c in sorted({r["commit"] for r in rows}))
    lines += ["", f"Commits {commits}; {rows[0]['hardware']}, {rows[0]['versions']}; rows in "
              "`benchmarks/results/ffdc.csv`; plot `benchmarks/results/ffdc.png`."]
    MD.write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [float(r) for r in rates]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in MODES:
        for ax, key in zip(axes, ("calls", "success")):
            v = np.array([vals(d, f"{m}_r{r}_{key}") for r in rates])  # (rates, seeds)
            ax.errorbar(x, v.mean(1), yerr=v.std(1, ddof=1) if v.shape[1] > 1 else None, marker="o", capsize=3,
                        label=LABEL[m])
    axes[0].set_ylabel("model calls per episode"), axes[1].set_ylabel("success rate")
    for ax in axes:
        ax.set_xlabel("perturbation probability per step"), ax.legend(fontsize=7)
    fig.suptitle(f"FFDC on the gridworld: fixed vs verifier-gated chunks (mean ± std, {n} seeds)", fontsize=10)
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
