"""Each script's default command, once: does it learn within its time budget on this machine?

    python benchmarks/run_defaults.py                    # runs the LLM scripts below with no flags (about 60 min)
    python benchmarks/run_defaults.py --record-only      # only (re)record runs/defaults/*/summary.json
    python benchmarks/run_defaults.py --report-only      # only rebuild benchmarks/results/defaults.md

Rows go to benchmarks/results/defaults.csv (seed 0, the default), the tables to benchmarks/results/defaults.md
(LLM scripts: held-out accuracy) and benchmarks/results/offline_defaults.md (offline RL: normalised score).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows  # noqa: E402

SCRIPTS = ["grpo", "ppo", "rloo", "dapo", "gspo", "opd", "async_opd", "self_opd", "spec_rl", "mc_grpo", "nat",
           "grpo_sums", "unique_grpo", "poise", "fp8_rollout", "fp8_sol_rl", "async_offpolicy_grpo", "espo",
           "tree_rollout_grpo", "partial_rollout", "grpo_prompt_selection", "grpo_replay"]
# runs that are not a script's bare default: name -> (script, its flags); the long-response task with its model
VARIANTS = {"grpo_sums": ("grpo", ["--model", "tiny-sums", "--task", "sums", "--digits", "1", "--max-new-tokens", "48",
                                   "--steps", "100"])}
OFFLINE = ["td3_bc", "iql", "ravl", "driftql"]  # their --out-dir is the run folder itself
OUT = ROOT / "runs" / "defaults"
CSV = "defaults.csv"


def command(name: str) -> list[str]:
    script, flags = VARIANTS.get(name, (name, []))
    return [f"algos/{script}.py", *flags]


def run(names, record_each: bool = True) -> None:
    for name in names:
        out = OUT / name if name in OFFLINE else OUT
        name_flag = ["--exp-name", name] if name in VARIANTS else []  # the run folder, not part of the command
        subprocess.run([sys.executable, *command(name), *name_flag, "--out-dir", str(out)], cwd=ROOT, check=True)
        if record_each:  # a later failure keeps the rows already measured
            record([name])


def record(names) -> None:
    for name in names:
        summary = json.loads((OUT / name / "summary.json").read_text())
        cmd = command(name)
        append_rows(CSV, "defaults", cmd[0], "default" if name not in VARIANTS else name, 0, summary,
                    "python " + " ".join(cmd))


def report() -> None:
    runs, offline = {}, {}
    for r in read_rows(CSV):  # keyed by command, then by run (a later run of the same command comes later)
        name = Path(r["script"]).stem
        if name in OFFLINE:
            offline.setdefault(r["script"], {})[r["metric"]] = r
        else:
            runs.setdefault(r["command"], {}).setdefault((r["commit"], r["timestamp"]), {})[r["metric"]] = r
    report_offline(offline)
    lines = ["| command | held-out acc start | end | gain (points) | previous gain | wall s | generated tokens/s | "
             "commit |", "|---|---|---|---|---|---|---|---|"]
    meta = None
    gain = lambda v: 100 * (v["eval_acc_end"] - v["eval_acc_start"])  # noqa: E731
    for cmd, by_run in runs.items():
        done = list(by_run.values())
        last, before = done[-1], (done[-2] if len(done) > 1 else None)
        v = {k: float(r["value"]) for k, r in last.items()}
        meta = last["eval_acc_end"]
        prev = "" if before is None else \
            f"{gain({k: float(r['value']) for k, r in before.items()}):+.1f} ({before['eval_acc_end']['commit']})"
        lines.append(f"| `{cmd}` | {100 * v['eval_acc_start']:.1f} | {100 * v['eval_acc_end']:.1f} | "
                     f"{gain(v):+.1f} | {prev} | {v['wall_s']:.0f} | {v.get('tokens_per_s', float('nan')):.0f} | "
                     f"{meta['commit']} |")
    if meta:
        lines += ["", f"Seed 0, each script's defaults (tiny-0.6m on 2-digit `add` unless the command says otherwise; "
                      f"500 held-out prompts, greedy); previous gain: the run before the latest, at its commit. "
                      f"Hardware: {meta['hardware']} (shared with other jobs, so wall "
                      f"times are upper bounds); {meta['versions']}. Rows: `benchmarks/results/{CSV}`; command: "
                      f"`python benchmarks/run_defaults.py`."]
    (RESULTS / "defaults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report_offline(latest) -> None:
    lines = ["| command | dataset | score at step 0 | last | best | behaviour | wall s |", "|---|---|---|---|---|---|---|"]
    meta = None
    for script, m in latest.items():
        v = {k: float(r["value"]) for k, r in m.items()}
        meta = next(iter(m.values()))
        dataset = {"ravl": "pendulum-expert", "driftql": "toy-multimodal"}.get(Path(script).stem, "pendulum-medium")
        lines.append(f"| `python {script}` | {dataset} | {v['score_first']:.1f} | {v['score_last']:.1f} | "
                     f"{v['score_best']:.1f} | {v['behaviour_score']:.1f} | {v['wall_s']:.0f} |")
    if meta:
        lines += ["", f"Seed 0, each script's defaults, one torch thread. Hardware: {meta['hardware']}; "
                      f"{meta['versions']}; commit {meta['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                      f"`python benchmarks/run_defaults.py --scripts {' '.join(OFFLINE)}`."]
        (RESULTS / "offline_defaults.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record-only", action="store_true", help="record existing runs/defaults summaries")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--scripts", nargs="+", default=SCRIPTS)
    a = ap.parse_args()
    if not (a.record_only or a.report_only):
        run(a.scripts)
    elif a.record_only:
        record(a.scripts)
    report()
