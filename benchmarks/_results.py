"""Results rows with provenance: every number in benchmarks/README.md comes from a CSV written through here.

Long format, one row per (run, metric): bench, script, config, seed, metric, value, plus the command,
git commit, hardware, library versions and a UTC timestamp. Each benchmark script turns its CSV into a table
(benchmarks/results/<name>.md); `benchmarks/report.py` puts the tables into benchmarks/README.md and the claims
table (benchmarks/results/claims.csv, one row per paper claim, its figures read from these CSVs) beside them.
"""
from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["bench", "script", "config", "seed", "metric", "value", "command", "commit", "hardware",
          "versions", "timestamp"]


def provenance() -> dict:
    """Commit, hardware and versions of the machine that makes the numbers."""
    import torch

    root = RESULTS.parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=root).stdout.strip() or "unknown"
        # tracked code that differs from that commit: the row says so ("+dirty"); results and runs do not count
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":(exclude)benchmarks/results", ":(exclude)runs"], capture_output=True, text=True,
                                 cwd=root).stdout.strip()
        commit += "+dirty" if changed and commit != "unknown" else ""
    except OSError:
        commit = "unknown"
    # a copy of the tree sent to another machine (a rented GPU box) is told its commit: its own .git may be stale
    commit = os.environ.get("PROVENANCE_COMMIT") or commit
    if torch.cuda.is_available():
        hw = torch.cuda.get_device_name(0)
    else:
        hw = f"{platform.machine()} cpu x{os.cpu_count()}"
    versions = f"python {platform.python_version()}; torch {torch.__version__}"
    try:
        import transformers

        versions += f"; transformers {transformers.__version__}"
    except ImportError:
        pass
    return {"commit": commit, "hardware": hw, "versions": versions,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def append_rows(csv_name: str, bench: str, script: str, config: str, seed: int, metrics: dict,
                command: str | None = None) -> None:
    """Append one run's figures (a dict metric -> number) to benchmarks/results/<csv_name>."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / csv_name
    prov = provenance()
    command = command or " ".join([Path(sys.executable).name] + sys.argv)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                w.writerow({"bench": bench, "script": script, "config": config, "seed": seed, "metric": metric,
                            "value": value, "command": command, **prov})


def read_rows(csv_name: str) -> list[dict]:
    path = RESULTS / csv_name
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def by_config_seed(csv_name: str, bench: str | None = None) -> tuple[dict, dict]:
    """The rows of a results CSV (of one bench, if given) as config -> seed -> metric -> value (a later row wins),
    and config -> its latest row (for provenance)."""
    from collections import defaultdict

    by, meta = defaultdict(lambda: defaultdict(dict)), {}
    for r in read_rows(csv_name):
        if bench is None or r["bench"] == bench:
            by[r["config"]][r["seed"]][r["metric"]] = float(r["value"])
            meta[r["config"]] = r
    return by, meta


def mean_std(vals, scale: float = 1.0, digits: int = 1, bare_single: bool = True) -> str:
    """'mean ± std' of vals times scale (sample std, n - 1); '-' for none; one value alone as 'x' (or 'x ± 0.0'
    when bare_single is False)."""
    import statistics

    if not vals:
        return "-"
    m = statistics.mean(vals) * scale
    if len(vals) == 1 and bare_single:
        return f"{m:.{digits}f}"
    sd = statistics.stdev(vals) * scale if len(vals) > 1 else 0.0
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def seed_ranges(seeds) -> str:
    """Seeds as runs of consecutive numbers: ['10', '11', '12', '20'] -> '10-12, 20'."""
    out = []
    for s in sorted(map(int, seeds)):
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def metric_lists(by: dict) -> dict:
    """config -> seed -> metrics (a part of `split_runs`) as config -> metric -> [its value at each seed]."""
    from collections import defaultdict

    out = defaultdict(lambda: defaultdict(list))
    for config, runs in by.items():
        for metrics in runs.values():
            for k, v in metrics.items():
                out[config][k].append(v)
    return out


def split_runs(by: dict, runs) -> list[tuple[tuple[int, int] | None, dict]]:
    """`by` (config -> seed -> metrics) split by run, so that no table pools seeds of different runs: first the seeds
    outside every (lo, hi) of `runs` (the script's first run), then each range that has rows (a fresh run of the
    claims plan, benchmarks/claims_plan.csv). A config without seeds in a part is left out of that part."""
    def part(keep):
        return {c: sub for c, d in by.items() if (sub := {s: m for s, m in d.items() if keep(int(s))})}

    first = part(lambda s: not any(lo <= s <= hi for lo, hi in runs))
    fresh = [((lo, hi), part(lambda s, lo=lo, hi=hi: lo <= s <= hi)) for lo, hi in runs]
    return [(None, first)] + [(r, d) for r, d in fresh if d]


def mean_over_budget(points: list[tuple[float, float]], budget: float) -> float:
    """The area under an accuracy curve [(x, accuracy)], x = rollouts, updates, steps or tokens, from 0 to `budget`
    (linear between evaluations, cut at the budget, flat after the last evaluation), divided by `budget`: the mean
    held-out accuracy over the budget, larger for a run that learns sooner. Unlike the x at which a run first reaches
    a target, it needs no target, censors no run and is not quantised to the evaluation interval."""
    area, (x0, a0) = 0.0, points[0]
    for x1, a1 in points[1:]:
        if x1 > budget:  # cut the segment at the budget
            a1, x1 = a0 + (a1 - a0) * (budget - x0) / (x1 - x0), budget
        area += (x1 - x0) * (a0 + a1) / 2
        x0, a0 = x1, a1
        if x0 >= budget:
            break
    return (area + max(budget - x0, 0) * a0) / budget


def fresh_run_tables(parts, cols, arms=None, population_std: bool = False, titles: dict | None = None) -> list[str]:
    """A markdown table per fresh run (the parts after the first from `split_runs`): a row per arm (in the order of
    `arms`, else as stored) with each column `(header, metric, scale, digits)` as mean ± std over its seeds (the
    sample std, or the population std where the script's own tables use it); a column no arm of a run recorded is
    left out of that run's table. `titles` may name what a run was, by its (lo, hi), where it was not a fresh run of
    the plan (a pilot)."""
    def cell(vals, scale, digits):
        if not population_std or len(vals) < 2:
            return mean_std(vals, scale, digits)
        m = sum(vals) / len(vals)
        sd = (sum((v - m) ** 2 for v in vals) / len(vals)) ** 0.5
        return f"{m * scale:.{digits}f} ± {sd * scale:.{digits}f}"

    lines, arms = [], None if arms is None else list(arms)  # an iterator would serve the first run only
    for (lo, hi), by in parts:
        what = (titles or {}).get((lo, hi), "a fresh run of the claims plan (benchmarks/claims_plan.csv) on the arms "
                                             "it compares")
        kept = [c for c in cols if any(c[1] in r for d in by.values() for r in d.values())]
        lines += ["", f"Seeds {lo}-{hi}, {what}:", "", "| arm | " + " | ".join(c[0] for c in kept) + " | seeds |",
                  "|---|" + "---|" * (len(kept) + 1)]
        for label in [a for a in (arms or by) if a in by]:
            runs = list(by[label].values())
            cells = [cell([r[m] for r in runs if m in r], scale, digits) for _, m, scale, digits in kept]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {seed_ranges(by[label])} |")
    return lines
