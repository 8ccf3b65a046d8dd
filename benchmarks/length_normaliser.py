"""GRPO's loss normaliser: per-trajectory 1/|tau_i| (seq-mean) versus a constant 1/k (const).

    python benchmarks/length_normaliser.py --setting sums --seeds 0 1 2   # on the long-response task
    python benchmarks/length_normaliser.py                 # 2 normalisers x seeds on addsteps (3 digits)
    python benchmarks/length_normaliser.py --report-only   # rebuilds the tables and plots from the CSVs

The claim (Bai et al., "AsyncWebRL: Efficient Multi-Step RL for Visual Web Agents", arXiv:2606.05597): when
failures are longer than successes, 1/|tau_i| gives each failed token a smaller share of the negative gradient,
so verbose failures persist; a constant 1/k removes that coupling and contracts responses at equal success.
Two test beds (--setting), algos/grpo.py with a generous max_new_tokens so a response can ramble:
`addsteps` with 3-digit operands (a scratchpad per column; tiny-0.6m solves almost none, so few groups carry
a signal) and `sums`, the long-response task (5 one-digit operands with running totals, tiny-sums solves about
half). Everything except --loss-agg is identical between the two arms (k = max_new_tokens). The script reports the measured length
of successes and failures at the start, since the claim's premise (failures longer) has to be checked, not
assumed.

Writes benchmarks/results/length_normaliser[_sums].csv, .md and .png; `python benchmarks/report.py` puts the table into
benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, fresh_run_tables, mean_std, read_rows,  # noqa: E402
                                 split_runs)

# setting -> (model, task, digits, results name); addsteps keeps its original file names
SETTINGS = {"addsteps": ("tiny-0.6m", "addsteps", 3, "length_normaliser"),
            "sums": ("tiny-sums", "sums", 1, "length_normaliser_sums")}
CSV, NAME, MODEL, TASK, DIGITS = "length_normaliser.csv", "length_normaliser", "tiny-0.6m", "addsteps", 3
ARMS = {"1/|tau| (seq-mean)": "seq-mean", "1/k (const)": "const"}
PLAN_RUNS = ((10, 12),)  # the claims plan's fresh run (benchmarks/claims_plan.csv)


def premise(max_new_tokens: int, n: int = 256) -> dict:
    """Mean sampled length of successes and failures of the starting policy (temperature 1)."""
    import numpy as np
    import torch

    import common
    from algos import _llm as llm

    torch.manual_seed(0)
    model, tok = common.load_model(MODEL)
    task = llm.make_task(TASK, DIGITS)
    ex = task.sample("train", n, np.random.default_rng(0))
    ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in ex]), 1, max_new_tokens)
    r = np.array([task.verify(t, e.answer)[0] for t, e in zip(ro.texts, ex)])
    L = ro.completion_mask.sum(1).numpy()
    return {"start_success_rate": float(r.mean()), "start_len_success": float(L[r == 1].mean()) if r.any() else -1,
            "start_len_failure": float(L[r == 0].mean()),
            "start_truncated": float(np.mean([f == "length" for f in ro.finish_reasons]))}


def run(seeds, steps: int, threads: int, max_new_tokens: int, prompts: int) -> None:
    from algos import grpo

    base = premise(max_new_tokens)
    print("starting policy:", base)
    append_rows(CSV, NAME, "algos/grpo.py", "premise", 0, base,
                f"python benchmarks/length_normaliser.py --setting {TASK}")
    for seed in seeds:
        for label, agg in ARMS.items():
            args = grpo.Args(model=MODEL, task=TASK, digits=DIGITS, max_new_tokens=max_new_tokens, prompts_per_step=prompts,
                             loss_agg=agg, steps=steps, seed=seed, eval_every=max(steps // 4, 1), eval_examples=200,
                             pass_k=0, eval_hard=False, threads=threads, out_dir=f"runs/bench_{NAME}/s{seed}",
                             exp_name=agg)
            s = grpo.main(args)
            rows = [json.loads(x) for x in open(Path(args.out_dir) / agg / "metrics.jsonl")]
            train = [r for r in rows if "rollout/length" in r]
            w = max(len(train) // 10, 1)  # windows of 10% of the run
            for i in range(0, len(train), w):
                win = train[i:i + w]
                s[f"len_at_step_{win[-1]['step']}"] = statistics.mean(r["rollout/length"] for r in win)
                s[f"reward_at_step_{win[-1]['step']}"] = statistics.mean(r["rollout/reward"] for r in win)
            s["len_first"] = statistics.mean(r["rollout/length"] for r in train[:w])
            s["len_last"] = statistics.mean(r["rollout/length"] for r in train[-w:])
            s["reward_last_window"] = statistics.mean(r["rollout/reward"] for r in train[-w:])
            s["truncated_last"] = statistics.mean(r["rollout/truncated_frac"] for r in train[-w:])
            cmd = (f"python algos/grpo.py --model {MODEL} --task {TASK} --digits {DIGITS} --max-new-tokens {max_new_tokens} "
                   f"--prompts-per-step {prompts} --loss-agg {agg} --steps {steps} --seed {seed} --threads {threads}")
            append_rows(CSV, NAME, "algos/grpo.py", label, seed, s, cmd)


def fmt(vals, scale=1.0, digits=1):
    return mean_std(vals, scale, digits, bare_single=False)


def report() -> None:
    rows = read_rows(CSV)
    by = defaultdict(lambda: defaultdict(dict))
    meta = {}
    for r in rows:
        by[r["config"]][r["seed"]][r["metric"]] = float(r["value"])
        meta[r["config"]] = r
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    lines = ["| normaliser | response length, first 10% of training | last 10% | train reward, last 10% | "
             "held-out acc start | end | groups with a reward signal | seeds |", "|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        if label not in by:
            continue
        runs = list(by[label].values())
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        lines.append(f"| {label.replace('|', chr(92) + '|')} | {fmt(get('len_first'))} | {fmt(get('len_last'))} | "
                     f"{fmt(get('reward_last_window'), 100)}% | {fmt(get('eval_acc_start'), 100)}% | "
                     f"{fmt(get('eval_acc_end'), 100)}% | "
                     f"{fmt([1 - v for v in get('zero_var_group_frac')], 100)}% | {len(runs)} |")
    if "premise" in by and meta:
        p = next(iter(by["premise"].values()))
        any_row = meta[next(k for k in meta if k != "premise")] if len(meta) > 1 else meta["premise"]
        cmd = re.sub(r"--seed \d+", "--seed SEED", any_row["command"])  # one row's seed would read as the only one
        lines += ["", f"Starting policy (`{MODEL}` on `{TASK}`, {DIGITS}-digit operands, temperature 1, 256 training prompts): success rate "
                  f"{100 * p['start_success_rate']:.1f}%, mean length of successes {p['start_len_success']:.1f} "
                  f"tokens vs failures {p['start_len_failure']:.1f}, truncated {100 * p['start_truncated']:.1f}%. "
                  f"Lengths count response tokens including EOS; 'groups with a reward signal' = groups whose 8 "
                  f"rewards were not all equal (the only ones that give GRPO a gradient). Each arm: `{cmd}` with `--loss-agg seq-mean` or "
                  f"`const` (k = max_new_tokens). Mean ± std over seeds; held-out = 200 prompts, greedy. "
                  f"Hardware: {any_row['hardware']} (shared); commit {any_row['commit']}. Rows: "
                  f"`benchmarks/results/{CSV}`; command: `python benchmarks/length_normaliser.py --setting {TASK}`.",
                  "", f"![1/|tau| vs 1/k: length and reward curves](results/{NAME}.png)"]
        signal = [1 - r["zero_var_group_frac"] for lab in ARMS for r in by.get(lab, {}).values()]
        if signal and max(signal) < 0.05:
            lines.insert(len(lines) - 2, f"\nInconclusive: at most {100 * max(signal):.1f}% of groups carried a "
                         "reward signal, so both normalisers applied (almost) no gradient and the arms stayed "
                         "together." + (" The premise also fails here: failures are shorter than successes."
                                        if p["start_len_failure"] < p["start_len_success"] else ""))
    cols = [("response length, first 10%", "len_first", 1, 1), ("last 10%", "len_last", 1, 1),
            ("train reward, last 10% (%)", "reward_last_window", 100, 1),
            ("held-out acc end (%)", "eval_acc_end", 100, 1)]
    # "|" escaped as in the table above: a bare one would split a markdown cell
    fresh = [(r, {c.replace("|", "\\|"): d for c, d in p.items()}) for r, p in parts[1:]]
    lines += fresh_run_tables(fresh, cols, [a.replace("|", "\\|") for a in ARMS])
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by)


def plot(by) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for label in ARMS:
        if label not in by:
            continue
        for ax, key in zip(axes, ("len_at_step_", "reward_at_step_")):
            curves = defaultdict(list)
            for r in by[label].values():
                for k, v in r.items():
                    if k.startswith(key):
                        curves[int(k.rsplit("_", 1)[-1])].append(v)
            xs = sorted(curves)
            m, sd = np.array([np.mean(curves[x]) for x in xs]), np.array([np.std(curves[x]) for x in xs])
            line, = ax.plot(xs, m, "o-", ms=3, label=label)
            ax.fill_between(xs, m - sd, m + sd, color=line.get_color(), alpha=0.15)
    axes[0].set(xlabel="rollout batch", ylabel="mean response length (tokens)", title="length")
    axes[1].set(xlabel="rollout batch", ylabel="train reward", title="success (sampled)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{TASK}, {DIGITS}-digit operands: 1/|tau| vs constant 1/k", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables and plots from the CSVs")
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="addsteps", help="the test bed (see the header)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per rollout batch (x 8 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for setting in [a.setting] if not a.report_only else [k for k, v in SETTINGS.items() if (RESULTS / f"{v[3]}.csv").exists()]:
        MODEL, TASK, DIGITS, NAME = SETTINGS[setting]
        CSV = f"{NAME}.csv"
        if not a.report_only:
            run(a.seeds, a.steps, a.threads, a.max_new_tokens, a.prompts)
        report()
