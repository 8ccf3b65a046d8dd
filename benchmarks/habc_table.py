"""HABC vs single-advantage AWBC vs BC on intervention data: success rate and steps to the goal over rounds.

Runs `algos/habc.py`'s `main(Args(...))` for every arm over seeds (default 0-4) at one torch thread, appends each
run's summary and its per-round evaluation (success_r<k>, steps_r<k>, takeovers_r<k>) to
benchmarks/results/habc.csv (with provenance, through benchmarks/_results.append_rows) and writes
benchmarks/results/habc.md (the block `results:habc` of benchmarks/README.md) and benchmarks/results/habc.png.

    python benchmarks/habc_table.py --jobs 2         # 5 arms x 5 seeds, about 4 min on two cores
    python benchmarks/habc_table.py --only HABC AWBC # some arms
    python benchmarks/habc_table.py --report-only    # rebuild the .md and .png from the CSV

Arms (each the default command plus its flags; every arm of one seed starts from the same SFT policy and draws
the same evaluation episodes): HABC (gated viability and efficiency advantages, intervention-aware labels); AWBC
(the viability, i.e. success, advantage alone: `--method awbc`); AWBC-return (one critic on a discounted success
return, `--method awbc --gamma 0.95`, a single scalar that carries some efficiency itself); BC (uniform weights on
the demos and the intervention steps, `--method bc`); HABC-episode-credit (the episode's outcome on every step,
`--credit episode`).
Plan, fixed before the runs (benchmarks/claims_plan.csv; 5 seeds per arm, from 3-seed pilots of the same arms):
success after the last round > the SFT policy's (HABC); steps to the goal after the last round HABC < AWBC,
HABC < BC and HABC < AWBC-return; success after the last round HABC ~ AWBC (margin 5 points) and HABC > BC;
success averaged over the rounds HABC > HABC-episode-credit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks._results import RESULTS, by_config_seed, mean_std, seed_ranges

CSV, MD, PNG = "habc.csv", RESULTS / "habc.md", RESULTS / "habc.png"
CONFIGS = {
    "HABC": ({}, ""),
    "AWBC": ({"method": "awbc"}, " --method awbc"),
    "AWBC-return": ({"method": "awbc", "gamma": 0.95}, " --method awbc --gamma 0.95"),
    "BC": ({"method": "bc"}, " --method bc"),
    "HABC-episode-credit": ({"credit": "episode"}, " --credit episode"),
}
LABEL = {"HABC": "HABC", "AWBC": "AWBC, success critic", "AWBC-return": "AWBC, discounted-return critic",
         "BC": "BC on demos + interventions", "HABC-episode-credit": "HABC, episode credit"}


def run_one(job: tuple[str, int, str]) -> tuple[str, int, dict]:
    """One arm and seed in this process (one torch thread): its summary plus the per-round evaluation."""
    import io
    from contextlib import redirect_stdout

    import torch

    from algos import habc

    name, seed, out_root = job
    torch.set_num_threads(1)
    out = Path(out_root) / f"{name}-s{seed}"
    with redirect_stdout(io.StringIO()):
        summary = habc.main(habc.Args(seed=seed, out_dir=str(out), exp_name=f"{name}-s{seed}", **CONFIGS[name][0]))
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        k = row["step"]
        summary[f"success_r{k}"], summary[f"steps_r{k}"] = row["eval/success"], row["eval/steps"]
        if "collect/takeovers" in row:
            summary[f"takeovers_r{k}"] = row["collect/takeovers"]
    return name, seed, summary


def run(names: list[str], seeds: list[int], out_root: Path, jobs: int) -> None:
    """Seed-major order; a (arm, seed) already in the CSV is skipped, so an interrupted run resumes."""
    from benchmarks._results import append_rows, read_rows

    done = {(r["config"], int(r["seed"])) for r in read_rows(CSV)}
    todo = [(n, s, str(out_root)) for s in seeds for n in names if (n, s) not in done]
    if jobs > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(jobs)
        results = pool.imap(run_one, todo)
    else:
        pool, results = None, map(run_one, todo)
    for name, seed, summary in results:
        append_rows(CSV, "habc", "algos/habc.py", name, seed, summary,
                    command=f"python algos/habc.py --seed {seed}{CONFIGS[name][1]}")
        print(f"{name} seed {seed}: success {summary['success_first']:.3f} -> {summary['success_last']:.3f}, steps "
              f"{summary['steps_first']:.1f} -> {summary['steps_last']:.1f} ({summary['wall_s']:.0f}s)", flush=True)
    if pool is not None:
        pool.close()


def vals(d: dict, key: str) -> list[float]:
    return [m[key] for m in d.values() if key in m]


def welch(a: list[float], b: list[float], digits: int) -> str:
    """mean(a) - mean(b) with Welch's 95% interval (benchmarks/report.py's rule)."""
    from benchmarks.report import welch_interval

    if min(len(a), len(b)) < 2:
        return "-"
    m = lambda v: (float(np.mean(v)), float(np.std(v, ddof=1)), len(v))  # noqa: E731
    lo, hi = welch_interval(m(a), m(b))
    return f"{np.mean(a) - np.mean(b):+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def tables(by: dict) -> list[str]:
    arms = [n for n in CONFIGS if n in by]
    n_seeds = sorted({len(by[n]) for n in arms})
    ms = lambda n, key, scale=1.0, digits=1: mean_std(vals(by[n], key), scale, digits)  # noqa: E731
    lines = ["`python algos/habc.py` (12 x 12 grid with pits, 12 rounds of 32 rollouts with simulated interventions, "
             "then advantage-weighted BC; evaluation: 200 episodes of the policy alone after SFT and after each "
             f"round), mean ± std over {', '.join(map(str, n_seeds))} seeds (sample std). Success in %; steps: steps "
             "to the goal of the successful evaluation episodes (the shortest paths take 20-22); takeovers: the "
             "expert's interventions per collected episode, averaged over the rounds.", "",
             "| arm | success after SFT | success, last round | success, mean over rounds | steps after SFT | steps, "
             "last round | steps beyond shortest, last | takeovers per episode | gate, last round | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in arms:
        gate = ms(n, "gate_mean_last", digits=2) if n not in ("BC",) else "-"
        gate = "0 (none)" if n.startswith("AWBC") else gate
        lines.append(f"| {LABEL[n]} | {ms(n, 'success_first', 100)} | {ms(n, 'success_last', 100)} | "
                     f"{ms(n, 'success_auc', 100)} | {ms(n, 'steps_first')} | {ms(n, 'steps_last')} | "
                     f"{ms(n, 'excess_last')} | {ms(n, 'takeovers_mean', digits=2)} | {gate} | {len(by[n])} |")
    if "HABC" in by and len(arms) > 1:
        h = by["HABC"]
        pct = lambda d, key: [100 * x for x in vals(d, key)]  # noqa: E731
        lines += ["", "HABC minus each other arm, difference of seed means with Welch's 95% interval:", "",
                  "| other arm | success, last round (points) | success, mean over rounds (points) | steps, last "
                  "round |", "|---|---|---|---|"]
        for n in arms[1:]:
            o = by[n]
            lines.append(f"| {LABEL[n]} | {welch(pct(h, 'success_last'), pct(o, 'success_last'), 1)} | "
                         f"{welch(pct(h, 'success_auc'), pct(o, 'success_auc'), 1)} | "
                         f"{welch(vals(h, 'steps_last'), vals(o, 'steps_last'), 1)} |")
    return lines


def plot(by: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for n in [n for n in CONFIGS if n in by]:
        rounds = sorted({int(k[len("success_r"):]) for m in by[n].values() for k in m if k.startswith("success_r")})
        for ax, key, scale in zip(axes, ("success", "steps"), (100, 1)):
            v = np.array([[m[f"{key}_r{r}"] * scale for r in rounds] for m in by[n].values()])  # (seeds, rounds)
            ax.errorbar(rounds, v.mean(0), yerr=v.std(0, ddof=1) if len(v) > 1 else None, marker="o", ms=3,
                        capsize=2, label=LABEL[n])
    axes[0].set(xlabel="round (0 = SFT)", ylabel="success (%)")
    axes[1].set(xlabel="round (0 = SFT)", ylabel="steps to goal (successes)")
    axes[1].legend(fontsize=7)
    fig.suptitle("HABC on a gridworld with simulated interventions (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)
    plt.close(fig)


def report() -> None:
    by, meta = by_config_seed(CSV, "habc")
    if not by:
        raise SystemExit(f"no rows in {RESULTS / CSV}: run the benchmark first")
    rows = list(meta.values())
    commits = ", ".join(f"`{c}`" for c in sorted({r["commit"] for r in rows}))
    # the main table and the plot compare the arms on the seeds they all ran; seeds that only some arms ran (a
    # claims plan's fresh run of two arms) get a table of their own, so that no comparison mixes seed sets
    shared = set.intersection(*(set(d) for d in by.values()))
    first = {n: {s: m for s, m in d.items() if s in shared} for n, d in by.items()}
    fresh = {n: f for n, d in by.items() if (f := {s: m for s, m in d.items() if s not in shared})}
    lines = tables(first)
    if fresh:
        seeds = seed_ranges({s for d in fresh.values() for s in d})
        lines += ["", f"Seeds {seeds}, which only these arms ran (a fresh run of the claims plan, "
                  "benchmarks/claims_plan.csv):", ""] + tables(fresh)[2:]
    lines += ["", f"Commits {commits}; {rows[0]['hardware']}, {rows[0]['versions']}; rows in "
              "`benchmarks/results/habc.csv`; plot `benchmarks/results/habc.png` (the seeds every arm ran)."]
    MD.write_text("\n".join(lines) + "\n")
    plot(first)
    print(f"wrote {MD.relative_to(ROOT)} and {PNG.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--only", nargs="+", default=None, help="arms to run (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, one thread each")
    ap.add_argument("--out-root", default="runs/habc_table", help="run directories")
    ap.add_argument("--report-only", action="store_true", help="rebuild the .md and .png from the CSV")
    args = ap.parse_args()
    names = list(CONFIGS) if args.only is None else args.only
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {list(CONFIGS)}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    if not args.report_only:
        run(names, args.seeds, Path(args.out_root), args.jobs)
    report()


if __name__ == "__main__":
    main()
