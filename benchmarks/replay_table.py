"""Experience replay: accuracy against generated tokens for reuse factor x maximum age, and RLEP's updates to
reach GRPO's peak.

    python benchmarks/replay_table.py                  # GRPO + RLEP (3 seeds), the replay grid (GRID_SEEDS)
    python benchmarks/replay_table.py --report-only    # rebuilds the tables from the CSV
    python benchmarks/replay_table.py --plan --seeds 10 11 12 13 14 15 16 17 18 19   # the claims plan's fresh run
    python benchmarks/replay_table.py --rlep-plan --seeds 30 31 32 33 34 35   # GRPO and RLEP only (bench rlep_plan)

--plan: the fresh seeds that benchmarks/claims_plan.csv asks for (GRPO and reuse 2, age 1 only, rows under the bench
`replay_plan`, reported in a table of their own), so that they neither pool with the first runs' seeds nor stand in
for them. --rlep-plan: the same for GRPO and RLEP (bench `rlep_plan`); every GRPO and RLEP run also records the area
under its accuracy curve against updates, divided by the updates (`acc_auc`, the mean held-out accuracy over the
run), which needs no target and censors no run, where updates to GRPO's peak are quantised to the evaluation
interval. Seeds 30-35 are the pilot of the claims plan's RLEP row, whose run is on fresh seeds.

The claims: the replay-buffer study (Arnal et al., "Efficient RL Training for LLMs with Experience Replay",
arXiv:2604.08706): a well-designed buffer cuts inference compute without degrading final accuracy, and keeps the
policy's entropy; RLEP (Zhang et al., "RLEP: Reinforcement Learning with Experience Replay for LLM Reasoning",
arXiv:2507.07451): replaying verified successes reaches the baseline's peak accuracy in fewer updates.

Runs (algos/grpo_replay.py, one file): the default task (tiny-0.6m, 2-digit `add`, a fixed training set of 256
prompts, 32 prompt groups x 8 completions per update, lr 1e-4), STEPS updates, held-out greedy accuracy on 500
prompts every EVAL_EVERY updates.
  GRPO        --reuse 1, and --experience-out: its final policy's verified successes (8 samples per training
              prompt) are RLEP's phase 1
  RLEP        --reuse 1 --experience-in (the same seed's GRPO successes), M = 2 per group; restarted from the
              initial policy
  reuse R, age A   --reuse R --max-age A: 32 / R fresh groups per update, the rest replayed (their ratio
              pi_theta / mu clipped as PPO's)
Accuracy at equal generated tokens: GRPO's held-out accuracy interpolated linearly between its evaluations at the
replay run's total generated tokens (same seed).

Writes benchmarks/results/replay.csv (rows through benchmarks/_results.py) and replay.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, mean_over_budget, mean_std, read_rows,  # noqa: E402
                                 seed_ranges, split_runs)

CSV, NAME, SCRIPT = "replay.csv", "replay", "algos/grpo_replay.py"
STEPS, EVAL_EVERY = 40, 4
GRID = {"reuse 2, age 1": (2, 1), "reuse 2, age 4": (2, 4), "reuse 4, age 1": (4, 1), "reuse 4, age 4": (4, 4)}
FLAGS = dict(steps=STEPS, pool_size=256, eval_every=EVAL_EVERY, eval_examples=500, pass_k=0, eval_hard=False,
             threads=1)
COMMON = f"--pool-size 256 --steps {STEPS} --eval-every {EVAL_EVERY} --eval-examples 500 --pass-k 0 --no-eval-hard --threads 1"


def curve(run_dir: Path) -> list[tuple[int, int, float]]:
    """[(update, generated tokens, held-out accuracy)] at every evaluation of a run."""
    return [(r["step"], r.get("rollout/gen_tokens", 0), r["eval/acc"])
            for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval/acc" in r]


def acc_at_tokens(points: list, tokens: float) -> float:
    """Accuracy interpolated linearly in generated tokens between the two evaluations around `tokens`."""
    for (_, t0, a0), (_, t1, a1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return a0 + (a1 - a0) * (tokens - t0) / max(t1 - t0, 1)
    return points[-1][2]


def updates_to(points: list, target: float) -> tuple[float, bool]:
    """The first evaluated update with accuracy at or above target (the last update if none: censored)."""
    for step, _, acc in points:
        if acc >= target - 1e-9:
            return float(step), True
    return float(points[-1][0]), False


PLAN, PLAN_ARMS = "replay_plan", ("reuse 2, age 1",)  # --plan: its bench and the replay arms it runs
PLAN_RUNS = ((10, 19), (100, 209))  # the fresh runs under --plan (benchmarks/claims_plan.csv)
RLEP_PLAN = "rlep_plan"  # --rlep-plan: the bench of the claims plan's fresh run of GRPO and RLEP
RLEP_RUNS = {(30, 35): "the pilot of the claims plan's RLEP row", (40, 49): "the claims plan's fresh run"}


def run(seeds, grid_seeds, plan: bool = False, rlep_plan: bool = False) -> None:
    """GRPO, then the grid (at grid_seeds), then RLEP from GRPO's successes; with `plan`, GRPO and PLAN_ARMS only;
    with `rlep_plan`, GRPO and RLEP only."""
    from algos import grpo_replay as rp

    bench, grid = (PLAN, {k: GRID[k] for k in PLAN_ARMS}) if plan else (RLEP_PLAN, {}) if rlep_plan else (NAME, GRID)
    for seed in seeds:
        out = Path(f"runs/bench_{bench}/s{seed}")
        out.mkdir(parents=True, exist_ok=True)
        exp = out / "experience.json"
        g = rp.main(rp.Args(reuse=1, max_age=0, experience_out=str(exp), seed=seed, out_dir=str(out), exp_name="grpo",
                            **FLAGS))
        grpo_curve = curve(out / "grpo")
        peak = g["eval_acc_best"]
        g_up, _ = updates_to(grpo_curve, peak)
        by_update = [(u, acc) for u, _, acc in grpo_curve]
        append_rows(CSV, bench, SCRIPT, "GRPO", seed, {**g, "updates_to_grpo_peak": g_up, "reached_grpo_peak": 1.0,
                                                       "acc_auc": mean_over_budget(by_update, STEPS)},
                    f"python {SCRIPT} --reuse 1 --max-age 0 --experience-out EXP.json {COMMON} --seed {seed}")
        for label, (reuse, age) in grid.items() if plan or rlep_plan or seed in grid_seeds else []:
            s = rp.main(rp.Args(reuse=reuse, max_age=age, seed=seed, out_dir=str(out), exp_name=f"r{reuse}a{age}",
                                **FLAGS))
            grpo_same = acc_at_tokens(grpo_curve, s["gen_tokens"])
            append_rows(CSV, bench, SCRIPT, label, seed,
                        {**s, "grpo_acc_at_equal_tokens": grpo_same, "gain_at_equal_tokens": s["eval_acc_end"] - grpo_same,
                         "token_fraction": s["gen_tokens"] / g["gen_tokens"]},
                        f"python {SCRIPT} --reuse {reuse} --max-age {age} {COMMON} --seed {seed}")
        if plan:
            continue
        r = rp.main(rp.Args(reuse=1, max_age=0, experience_in=str(exp), seed=seed, out_dir=str(out), exp_name="rlep",
                            **FLAGS))
        rlep_curve = curve(out / "rlep")
        up, reached = updates_to(rlep_curve, peak)
        append_rows(CSV, bench, SCRIPT, "RLEP", seed,
                    {**r, "updates_to_grpo_peak": up, "reached_grpo_peak": float(reached), "grpo_peak": peak,
                     "acc_auc": mean_over_budget([(u, acc) for u, _, acc in rlep_curve], STEPS)},
                    f"python {SCRIPT} --reuse 1 --max-age 0 --experience-in EXP.json {COMMON} --seed {seed}")


def compare(a: list, b: list, spec: str, digits: int) -> str:
    """a minus b over two lists of per-seed values: the difference, its Welch 95% interval and where the interval lies
    (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    import statistics

    from benchmarks.report import describe_comparison

    stat = lambda v: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))  # noqa: E731
    return describe_comparison(spec, [stat(a), stat(b)], digits)


def rlep_lines(rlep_runs: dict) -> list[str]:
    """The runs of GRPO and RLEP under `--rlep-plan` (the claims plan's pilot, then its fresh run), each in a table
    of its own, with its comparison."""
    lines = []
    for (lo, hi), what in RLEP_RUNS.items():
        rlep = {c: sub for c, d in rlep_runs.items() if (sub := {s: m for s, m in d.items() if lo <= int(s) <= hi})}
        if rlep:
            lines += rlep_run_lines(rlep, what)
    return lines


def rlep_run_lines(rlep: dict, what: str) -> list[str]:
    lines = ["", f"GRPO and RLEP (`--rlep-plan`), {what} (RLEP replays the same seed's GRPO successes):", "",
             "| run | held-out acc end | mean acc over the updates | updates to GRPO's peak | reached | seeds |",
             "|---|---|---|---|---|---|"]
    for label in ("GRPO", "RLEP"):
        runs = list(rlep.get(label, {}).values())
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        if runs:
            lines.append(f"| {label} | {mean_std(get('eval_acc_end'), 100)} | {mean_std(get('acc_auc'), 100)} | "
                         f"{mean_std(get('updates_to_grpo_peak'), 1, 1)} | "
                         f"{int(sum(get('reached_grpo_peak')))}/{len(runs)} | "
                         f"{seed_ranges(rlep[label])} ({len(runs)}) |")
    if rlep.get("RLEP") and rlep.get("GRPO"):
        auc = lambda label: [100 * r["acc_auc"] for r in rlep[label].values()]  # noqa: E731
        lines += ["", "Mean held-out accuracy over the updates (the area under the accuracy curve against updates, "
                  "divided by the updates), RLEP minus GRPO, on this run alone (the claims table gives the verdict): "
                  f"{compare(auc('RLEP'), auc('GRPO'), '0>1', 1)}."]
    return lines


def report() -> None:
    by, meta = defaultdict(dict), {}  # config -> seed -> metrics (a later row wins)
    fresh, rlep = defaultdict(dict), defaultdict(dict)  # the claims plan's fresh runs, each in a table of its own
    for r in read_rows(CSV):
        part = {PLAN: fresh, RLEP_PLAN: rlep}.get(r["bench"], by)
        part[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        if part is by:  # the first runs' provenance (the fresh runs' rows carry their own)
            meta[r["config"]] = r
    lines = ["| run | held-out acc end | best | generated tokens | tokens vs GRPO | GRPO's acc at equal tokens | "
             "entropy first -> last | replayed rows | seeds |", "|---|---|---|---|---|---|---|---|---|"]
    for label in ["GRPO", *GRID]:
        runs = list(by.get(label, {}).values())
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_end'), 100)} | {mean_std(get('eval_acc_best'), 100)} | "
                     f"{mean_std(get('gen_tokens'), 1, 0)} | {mean_std(get('token_fraction'), 1, 2) if label != 'GRPO' else '1'} | "
                     f"{mean_std(get('grpo_acc_at_equal_tokens'), 100)} | {mean_std(get('entropy_first'), 1, 3)} -> "
                     f"{mean_std(get('entropy_last'), 1, 3)} | {mean_std(get('replayed_frac'), 100)}% | {len(runs)} |")
    lines += ["", "| run | held-out acc end | best | updates to GRPO's peak | reached | seeds |", "|---|---|---|---|---|---|"]
    for label in ("GRPO", "RLEP"):
        runs = list(by.get(label, {}).values())
        if runs:
            get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
            lines.append(f"| {label} | {mean_std(get('eval_acc_end'), 100)} | {mean_std(get('eval_acc_best'), 100)} | "
                         f"{mean_std(get('updates_to_grpo_peak'), 1, 1)} | {int(sum(get('reached_grpo_peak')))}/{len(runs)} | "
                         f"{len(runs)} |")
    if meta:
        row = next(iter(meta.values()))
        start = [r["eval_acc_start"] for r in by["GRPO"].values()]
        lines += ["", f"tiny-0.6m on 2-digit `add` from a fixed training set of 256 prompts, {STEPS} updates of 32 "
                  f"prompt groups x 8 completions (fresh: 32 / reuse groups, the rest replayed with the ratio "
                  f"pi_theta / mu clipped as PPO's), lr 1e-4; held-out greedy accuracy on 500 prompts every {EVAL_EVERY} "
                  f"updates, start {mean_std(start, 100)}. GRPO's accuracy at equal tokens is interpolated between its "
                  f"evaluations (same seed). Entropy: mean per-token entropy of the trained rows at the first and the "
                  f"last update. RLEP replays the same seed's GRPO run's final-policy successes (phase 1 costs that "
                  f"whole run) and restarts from the initial policy; updates to GRPO's peak are counted at "
                  f"evaluations (every {EVAL_EVERY}); a run that never reaches it counts all {STEPS} (a lower bound, "
                  f"see `reached`). Mean ± std over seeds. Hardware: {row['hardware']} (shared); {row['versions']}; "
                  f"commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                  f"`python benchmarks/replay_table.py`."]
        get = lambda label, k: [r[k] for r in by[label].values()]  # noqa: E731
        pct = lambda label, k: [100 * x for x in get(label, k)]  # noqa: E731
        r2, peak_key = "reuse 2, age 1", "updates_to_grpo_peak"
        lines += ["", "At reuse 2 a group's second use is always the next update, so any maximum age >= 1 gives the "
                  "same run (the age 1 and age 4 rows are identical); age matters from reuse 3 on. Each comparison on "
                  "this table's seeds alone (the difference of the seed means, its Welch 95% interval and where it "
                  "lies; the claims table gives the verdicts, on fresh seeds): held-out accuracy in points, reuse 2 "
                  "minus GRPO at equal generated tokens: "
                  f"{compare(pct(r2, 'eval_acc_end'), pct(r2, 'grpo_acc_at_equal_tokens'), '0>1', 1)}; at equal "
                  f"updates, with half the tokens: "
                  f"{compare(pct(r2, 'eval_acc_end'), pct('GRPO', 'eval_acc_end'), '0~1', 1)}; entropy at the last "
                  f"update: {compare(get(r2, 'entropy_last'), get('GRPO', 'entropy_last'), '0~1', 3)}; updates to "
                  f"GRPO's peak, RLEP minus GRPO: "
                  f"{compare(get('RLEP', peak_key), get('GRPO', peak_key), '0<1', 1)}."]
    for (lo, hi), run in split_runs(fresh, PLAN_RUNS)[1:]:  # each fresh run in a table of its own
        lines += ["", f"The claims plan's fresh run of seeds {lo}-{hi} (`--plan`: GRPO and reuse 2, age 1 only):", "",
                  "| run | held-out acc end | GRPO's acc at equal tokens | entropy last | seeds |", "|---|---|---|---|---|"]
        for label in ("GRPO", *PLAN_ARMS):
            runs = list(run.get(label, {}).values())
            get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
            if runs:
                lines.append(f"| {label} | {mean_std(get('eval_acc_end'), 100)} | "
                             f"{mean_std(get('grpo_acc_at_equal_tokens'), 100) if label != 'GRPO' else '-'} | "
                             f"{mean_std(get('entropy_last'), 1, 3)} | {seed_ranges(run[label])} ({len(runs)}) |")
    lines += rlep_lines(rlep)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--grid-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--plan", action="store_true",
                    help="the claims plan's fresh run: GRPO and reuse 2, age 1 at --seeds, under the bench replay_plan")
    ap.add_argument("--rlep-plan", action="store_true",
                    help="the claims plan's fresh run of RLEP: GRPO and RLEP at --seeds, under the bench rlep_plan")
    a = ap.parse_args()
    if a.plan and a.rlep_plan:
        ap.error("--plan and --rlep-plan are two runs: pass one")
    if not a.report_only:
        run(a.seeds, a.grid_seeds, a.plan, a.rlep_plan)
    report()
