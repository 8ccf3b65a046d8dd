"""World models: prediction error vs horizon across scripts, and policy evaluation in a learned model.

Runs each configuration's `main(Args(...))` over seeds (default 0 1 2), appends every summary figure to
benchmarks/results/world_models.csv (with provenance, through benchmarks/_results.py), and writes
benchmarks/results/world_models.md (the block `results:world_models` of benchmarks/README.md) and
benchmarks/results/world_models.png (mean error curves). The seed-0 frame strips are copied next to them.

    python benchmarks/world_models_table.py                 # everything, about 20-25 min at 1 thread
    python benchmarks/world_models_table.py --only live ar  # some configurations
    python benchmarks/world_models_table.py --report-only   # rebuild the .md and .png from the CSV

All configurations train with horizon 8 (the chain / cycle length) and are evaluated on 256 held-out
trajectories rolled out 32 steps (4x) from ground-truth frames with the true actions.
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks._results import RESULTS, append_rows, fresh_run_tables, read_rows, split_runs

CSV, MD, PNG = "world_models.csv", RESULTS / "world_models.md", RESULTS / "world_models.png"
HORIZONS = (1, 8, 16, 32)
PLAN_RUNS = ((10, 16),)  # the claims plan's fresh run (benchmarks/claims_plan.csv)


# the default's seven eps-greedy policies, then six that differ in kind (worldmodels/policy_eval.py, parse_policy):
# a detour to a decoy object first, competent only near the goal, standing still at random
KINDS = ("0", "0.1", "0.2", "0.35", "0.5", "0.7", "1", "detour=6", "detour=9", "near=2", "near=4", "stall=0.5",
         "stall=0.7")


def configs() -> dict:
    from worldmodels import ar_world_model, diffusion_world_model, live, policy_eval

    return {
        "ar": (ar_world_model, dict(), "python worldmodels/ar_world_model.py"),
        "ar-chained": (ar_world_model, dict(chained=True), "python worldmodels/ar_world_model.py --chained"),
        "diffusion": (diffusion_world_model, dict(), "python worldmodels/diffusion_world_model.py"),
        "live": (live, dict(mode="live"), "python worldmodels/live.py"),
        "diffusion-forcing": (diffusion_world_model, dict(diffusion_forcing=True, ctx_sigma_eval=0.1),
                              "python worldmodels/diffusion_world_model.py --diffusion-forcing --ctx-sigma-eval 0.1"),
        "diffusion-forcing-clean": (diffusion_world_model, dict(diffusion_forcing=True),
                                    "python worldmodels/diffusion_world_model.py --diffusion-forcing"),
        "policy-eval": (policy_eval, dict(), "python worldmodels/policy_eval.py"),
        "policy-eval-no-consistency": (policy_eval, dict(consistency=0.0),
                                       "python worldmodels/policy_eval.py --consistency 0"),
        "policy-eval-g-trained": (policy_eval, dict(frozen_g=False),
                                  "python worldmodels/policy_eval.py --no-frozen-g"),
        "policy-eval-ungated": (policy_eval, dict(action_gate=False),
                                "python worldmodels/policy_eval.py --no-action-gate"),
        "policy-eval-kinds": (policy_eval, dict(policies=KINDS),
                              "python worldmodels/policy_eval.py --policies " + " ".join(KINDS)),
    }


def run(names: list[str], seeds: list[int], out_root: Path) -> None:
    import torch

    torch.set_num_threads(1)
    table = configs()
    for seed in seeds:
        for name in names:
            mod, kw, cmd = table[name]
            out = out_root / f"{name}_s{seed}"
            summary = mod.main(mod.Args(seed=seed, out_dir=str(out), exp_name=f"{name}_s{seed}", **kw))
            flat = dict(summary)
            for key in ("err_curve", "real_success", "imagined_success", "imagined_success_term"):
                for i, v in enumerate(flat.pop(key, []) or []):
                    flat[f"{key}_{i + 1}" if key == "err_curve" else f"{key}_{i}"] = v
            append_rows(CSV, "world_models", name, json.dumps(kw, sort_keys=True), seed, flat,
                        command=f"{cmd} --seed {seed}")
            for png in ("strip.png", "policy_eval.png"):
                if seed == 0 and (out / png).exists():
                    shutil.copy(out / png, RESULTS / f"world_models_{name}_{png}")
            print(f"{name} seed {seed}: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items()
                                                        if isinstance(v, float) and ("err_h" in k or k in (
                                                            "pearson", "mmrv", "wall_s"))), flush=True)


MODEL_CHANGE = "c3b6284"  # the commit where the agent-cell error became strict (exactly one agent drawn)
GATE_CHANGE = "f62910b"  # the commit where the action began to enter multiplicatively (--action-gate by default)
MODELS = ("ar", "ar-chained", "diffusion", "live", "diffusion-forcing", "diffusion-forcing-clean")
PE_NAMES = ("policy-eval", "policy-eval-no-consistency", "policy-eval-g-trained", "policy-eval-ungated")
PE_KINDS = "policy-eval-kinds"


@functools.cache
def _contains(commit: str, change: str) -> bool:
    """Whether `commit` contains the commit `change` (False when git cannot tell)."""
    import subprocess

    r = subprocess.run(["git", "merge-base", "--is-ancestor", change, commit], cwd=ROOT, capture_output=True)
    return r.returncode == 0


def _after_model_change(commit: str) -> bool:
    return _contains(commit, MODEL_CHANGE)


def collect_rows(keep=lambda row: True) -> dict:
    """{script: {metric: [values over seeds]}} from the CSV (the latest kept row per script/seed/metric),
    {script: the last of those rows} and the list of those rows; `keep(row)` filters the rows first."""
    latest = {}
    for r in read_rows(CSV):
        if keep(r):
            latest[(r["script"], r["seed"], r["metric"])] = (float(r["value"]), r)
    out = defaultdict(lambda: defaultdict(list))
    meta, used = {}, []
    for (script, seed, metric), (v, r) in sorted(latest.items()):
        out[script][metric].append(v)
        meta[script] = r
        used.append(r)
    return out, meta, used


def fmt(vals: list[float], digits: int = 4) -> str:
    if not vals:
        return "-"
    a = np.asarray(vals, dtype=float)
    ok = a[np.isfinite(a)]
    if len(ok) < len(a):  # e.g. Pearson when every imagined success rate is equal: undefined in that seed
        head = fmt(list(ok), digits) if len(ok) else "undefined"
        return f"{head} (undefined in {len(a) - len(ok)} of {len(a)} seeds)"
    return f"{a.mean():.{digits}f} ± {a.std():.{digits}f}" if len(a) > 1 else f"{a[0]:.{digits}f}"


def report() -> None:
    # the first run; each fresh run of the claims plan gets a table of its own (fresh_lines)
    data, meta, used = collect_rows(lambda r: not any(lo <= int(r["seed"]) <= hi for lo, hi in PLAN_RUNS))
    if not data:
        raise SystemExit(f"no rows in {RESULTS / CSV}: run the benchmark first")
    order = [n for n in MODELS if n in data]
    lines = error_lines(data, order) + policy_eval_lines(data) + fresh_lines() + provenance_lines(meta, used)
    MD.write_text("\n".join(lines) + "\n")
    plot_errors(data, order)
    print(f"wrote {MD.relative_to(ROOT)} and {PNG.relative_to(ROOT)}")


def error_lines(data: dict, order: list[str]) -> list[str]:
    """The error-against-horizon table of the world models (copy x_0 as the floor) and the paired comparisons."""
    lines = ["Pixel MSE (frames in [0, 1]) and agent-cell error rate (fraction of rollouts whose agent is in the "
             "wrong cell) at horizon h, rolled out from ground truth with the true actions; training horizon 8, "
             "so h = 16 and 32 are 2x and 4x beyond it. Mean ± std over the seeds counted in the last column "
             "(a single number: one seed); copy = predicting the initial frame forever.", "",
             "| script | " + " | ".join(f"MSE h={h}" for h in HORIZONS) + " | "
             + " | ".join(f"agent err h={h}" for h in HORIZONS) + " | wall s | seeds |",
             "|---" * (2 * len(HORIZONS) + 3) + "|"]
    for n in order:
        d = data[n]
        lines.append(f"| `{n}` | " + " | ".join(fmt(d.get(f"err_h{h}", [])) for h in HORIZONS) + " | "
                     + " | ".join(fmt(d.get(f"agent_err_h{h}", []), 2) for h in HORIZONS)
                     + f" | {fmt(d.get('wall_s', []), 0)} | {len(d.get('err_h1', []))} |")
    if order:
        d = data[order[0]]
        lines.append("| copy x_0 | " + fmt(d.get("copy_err_h1", [])) + " | | | " + fmt(d.get("copy_err_h32", []))
                     + " |" + " |" * (len(HORIZONS) + 2))
    pairs = [("teacher forcing", "ar", "chained training (Memory Forcing)", "ar-chained"),
             ("the denoiser without the cycle loss", "diffusion", "with it (LIVE)", "live"),
             ("the denoiser trained on clean context", "diffusion", "trained with per-frame context noise (diffusion "
              "forcing), 0.1 noise on the context at sampling", "diffusion-forcing"),
             ("the denoiser trained on clean context", "diffusion", "trained with per-frame context noise (diffusion "
              "forcing), clean context (noise level 0) at sampling", "diffusion-forcing-clean")]
    for a_name, a, b_name, b in pairs:
        if a in data and b in data:
            da, db = data[a], data[b]
            lines += ["", f"Compounding error, {a_name} (`{a}`) vs {b_name} (`{b}`), agent err at h = 8 / 16 / 32: "
                      + " / ".join(f"{fmt(da.get(f'agent_err_h{h}', []), 2)} vs {fmt(db.get(f'agent_err_h{h}', []), 2)}"
                                   for h in HORIZONS[1:])
                      + "; pixel MSE at h = 32: " + f"{fmt(da.get('err_h32', []))} vs {fmt(db.get('err_h32', []))}"
                      + f" (copy x_0 {fmt(da.get('copy_err_h32', []))})."]
    return lines


def policy_eval_lines(data: dict) -> list[str]:
    """The table of policy evaluation in a learned world model (empty without policy_eval rows)."""
    lines = []
    pe_names = [n for n in PE_NAMES if n in data]
    if pe_names:
        n_pol = len([k for k in data[pe_names[0]] if k.startswith("real_success_")])
        lines += ["", f"Policy evaluation in a learned world model ({n_pol} scripted policies, eps-greedy shortest "
                  "path with eps = 0, .1, .2, .35, .5, .7, 1; 200 episodes of 12 steps each; "
                  "`worldmodels/policy_eval.py`; its default feeds the frame times each action's indicator to the "
                  "forward model (`--action-gate`) and trains it with the forward-inverse consistency term, g held "
                  "fixed in it; `--consistency 0` drops the term, `--no-frozen-g` lets the term train g too, "
                  "`--no-action-gate` gives the model the one-hot action planes only):", "",
                  "| figure | " + " | ".join(f"`{n}`" for n in pe_names) + " |", "|---" * (len(pe_names) + 1) + "|"]
        for key, label in (("pearson", "Pearson r, imagined vs real success"), ("mmrv", "MMRV"),
                           ("pearson_term", "Pearson r with inverse-dynamics termination"),
                           ("mmrv_term", "MMRV with termination"), ("terminated_frac", "episodes terminated"),
                           ("one_step_agent_acc", "one-step agent-cell accuracy on executed rollouts"),
                           ("agent_err_h12", "open-loop agent-cell error after 12 steps")):
            lines.append(f"| {label} | " + " | ".join(fmt(data[n].get(key, []), 3) for n in pe_names) + " |")
        lines.append("| seeds | " + " | ".join(str(len(data[n].get("pearson", []))) for n in pe_names) + " |")
        for key, label in (("real_success", "real success per policy"),
                           ("imagined_success", "imagined success per policy")):
            lines.append(f"| {label} | " + " | ".join(", ".join(
                f"{np.mean(data[n][f'{key}_{i}']):.2f}" for i in range(n_pol)) for n in pe_names) + " |")
    if PE_KINDS in data:
        d = data[PE_KINDS]
        lines += ["", f"Policies that differ in kind (`{PE_KINDS}`: the default model and training, evaluated on the "
                  "seven eps-greedy policies and six others: `detour=K` walks the shortest path to a decoy object "
                  "(a non-goal object) for K steps before heading for the goal, `near=D` takes the shortest path only "
                  "within distance D of the goal and random moves elsewhere, `stall=P` takes the shortest path but "
                  f"stands still with probability P; {len(d.get('pearson', []))} seeds):", "",
                  "| policy | real success | imagined success |", "|---|---|---|"]
        for i, spec in enumerate(KINDS):
            lines.append(f"| `{spec}` | {fmt(d.get(f'real_success_{i}', []), 2)} | "
                         f"{fmt(d.get(f'imagined_success_{i}', []), 2)} |")
        lines += ["", "| figure | all 13 | the seven eps-greedy | the six others |", "|---|---|---|---|"]
        for key, label in (("pearson", "Pearson r"), ("mmrv", "MMRV")):
            lines.append(f"| {label} | " + " | ".join(fmt(d.get(k, []), 3) for k in (key, f"{key}_eps", f"{key}_kinds"))
                         + " |")
    return lines


def fresh_lines() -> list[str]:
    """A table per fresh run of the claims plan: the figures its rows compare, a row per script."""
    by = defaultdict(lambda: defaultdict(dict))  # script -> seed -> metric -> value (a later row wins)
    for r in read_rows(CSV):
        by[r["script"]][r["seed"]][r["metric"]] = float(r["value"])
    cols = [(f"agent err h={h}", f"agent_err_h{h}", 1, 2) for h in HORIZONS[1:]] + [
        ("Pearson r, imagined vs real success", "pearson", 1, 3), ("with termination", "pearson_term", 1, 3)]
    # the population std, as this file's other tables (and the claims table for world_models.csv) use
    return fresh_run_tables(split_runs(by, PLAN_RUNS)[1:], cols, MODELS + PE_NAMES, population_std=True)


def provenance_lines(meta: dict, used: list[dict]) -> list[str]:
    """Notes on rows measured before a change of the models or of the metric, then commits, hardware and versions."""
    lines = []
    any_row = next(iter(meta.values()))
    commits = ", ".join(f"`{c}`" for c in sorted({r["commit"] for r in used}))
    gated = {c: _contains(c, GATE_CHANGE) for c in {r["commit"] for r in read_rows(CSV)}}
    before, _, _ = collect_rows(lambda r: r["script"] in MODELS and not gated[r["commit"]])
    ungated_now = sorted({r["script"] for r in used if r["script"] in MODELS and not gated[r["commit"]]})
    if before and not ungated_now:
        lines += ["", f"Before `{GATE_CHANGE}` the action entered these models as one-hot input planes only; since "
                  "then it also enters multiplicatively by default (`--action-gate`: the last frame times each "
                  "action's indicator), the only change to the models. Agent err h=1 of the last ungated rows "
                  "(counting the brightest cell of the agent channel, as those rows did): " + ", ".join(
                      f"`{n}` {fmt(before[n].get('agent_err_h1', []), 2)} ({len(before[n].get('agent_err_h1', []))} "
                      "seeds)" for n in MODELS if n in before) + "."]
    stale = sorted({r["commit"] for r in used if not _after_model_change(r["commit"])})
    if stale:
        scripts = sorted({r["script"] for r in used if not _after_model_change(r["commit"])})
        lines += ["", f"Rows of {', '.join(f'`{n}`' for n in scripts)} from commits {', '.join(f'`{c}`' for c in stale)} "
                  f"predate `{MODEL_CHANGE}`: in them the "
                  "agent-cell error took the brightest cell of the agent channel; it now counts a prediction right "
                  "only when exactly one agent is drawn, in the true cell (500 training steps on 500 trajectories gave 1.00 "
                  "for `diffusion` and 0.93 for `ar-chained` at h=1, seed 0, without the action gate)."]
    lines += ["", f"Commits {commits}; {any_row['hardware']}, {any_row['versions']}; "
              "rows in `benchmarks/results/world_models.csv`; curves in `benchmarks/results/world_models.png`."]
    return lines


def plot_errors(data: dict, order: list[str]) -> None:
    """Pixel MSE and agent-cell error against the horizon, one line per model (band: min..max over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for n in order:
        d = data[n]
        hs = sorted(int(k.split("_")[-1]) for k in d if k.startswith("err_curve_"))
        if hs:
            curves = np.array([d[f"err_curve_{h}"] for h in hs])  # (H, seeds)
            axes[0].plot(hs, curves.mean(1), label=n)
            axes[0].fill_between(hs, curves.min(1), curves.max(1), alpha=0.2)
        agent = [np.mean(d.get(f"agent_err_h{h}", [np.nan])) for h in HORIZONS]
        axes[1].plot(HORIZONS, agent, "o-", label=n)
    if order and "copy_err_h1" in data[order[0]]:
        d = data[order[0]]
        axes[0].plot([1, 32], [np.mean(d["copy_err_h1"]), np.mean(d["copy_err_h32"])], ":", color="grey",
                     label="copy x_0")
    for ax, yl in zip(axes, ("pixel MSE", "agent-cell error rate")):
        ax.axvline(8, color="k", lw=0.6, ls=":")
        ax.set_xlabel("horizon (training horizon 8)"), ax.set_ylabel(yl), ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle("World models: error vs horizon (mean over seeds, band = min..max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", default=None, help="configurations to run (default: all)")
    ap.add_argument("--out-root", default="runs/world_models_table", help="run directories")
    ap.add_argument("--report-only", action="store_true", help="rebuild the .md and .png from the CSV")
    args = ap.parse_args()
    names = list(configs()) if args.only is None else args.only
    bad = [n for n in names if n not in configs()]
    if bad:
        raise SystemExit(f"unknown configuration(s) {bad}; choose from {list(configs())}")
    if not args.report_only:
        run(names, args.seeds, Path(args.out_root))
    report()


if __name__ == "__main__":
    main()
