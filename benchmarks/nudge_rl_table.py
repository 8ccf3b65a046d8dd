"""NudgeRL, P^2O and LENS against GRPO on the tiny policy (algos/nudge_rl.py, every other setting at its default).

    python benchmarks/nudge_rl_table.py                  # 7 configurations x 3 seeds, about 12 minutes, one thread
    python benchmarks/nudge_rl_table.py --report-only    # rebuild the table from the committed CSV
    python benchmarks/report.py                          # paste it into the READMEs

The claims under test: strategy nudging (rollouts split over hint contexts, inter/intra-context advantages and
distillation into the bare prompt) beats GRPO at equal and at larger rollout budgets ("Nudging Beyond the Comfort
Zone: Efficient Strategy-Guided Exploration for RLVR", arXiv:2605.15726); a prompt search for all-fail prompts with
context distillation recovers their signal and beats GRPO ("P^2O: Joint Policy and Prompt Optimization",
arXiv:2603.21877); purifying noisy prompts and transferring the purified prompts' successes beats GRPO on noisy
prompts ("Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction Purification",
arXiv:2601.21244). The accuracy is the bare (unconditioned) prompt's held-out greedy accuracy.
Rows: benchmarks/results/nudge_rl.csv; table: benchmarks/results/nudge_rl.md.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, mean_std, read_rows  # noqa: E402

CSV = "nudge_rl.csv"
GRPO = {"hints": ("none",), "distill_coef": 0.0}
CONFIGS = [  # (config name, overrides of nudge_rl.Args, label)
    ("grpo-g8", GRPO, "GRPO, 8 rollouts per prompt"),
    ("nudge-g8", {}, "NudgeRL: none + units hints, 4 rollouts each, distillation"),
    ("grpo-g16", {**GRPO, "group_size": 16}, "GRPO, 16 rollouts per prompt (2x budget)"),
    ("p2o-g8", {"hints": ("none",), "p2o": True}, "P^2O: GRPO + hint-prefix search on all-fail prompts"),
    ("grpo-noise1", {**GRPO, "noise": 1}, "GRPO on prompts with 1 distractor letter"),
    ("lens-noise1", {"hints": ("none",), "noise": 1, "lens": True}, "LENS on prompts with 1 distractor letter (remove 2)"),
    # added after the table above was read: removing 2 tokens for 1 distractor never restores the clean prompt
    ("lens-noise1-r1", {"hints": ("none",), "noise": 1, "lens": True, "lens_remove": 1},
     "LENS, removing 1 token (added after the first run)"),
]


def flags(over: dict) -> str:
    out = []
    for k, v in over.items():
        k = k.replace("_", "-")
        if v is True:
            out.append(f"--{k}")
        elif isinstance(v, tuple):
            out.append(f"--{k} {' '.join(v)}")
        else:
            out.append(f"--{k} {v}")
    return " ".join(out)


def run(seeds) -> None:
    from algos import nudge_rl

    done = {(r["config"], int(r["seed"])) for r in read_rows(CSV)}  # resumable
    for seed in seeds:
        for name, over, _ in CONFIGS:
            if (name, seed) in done:
                continue
            s = nudge_rl.main(nudge_rl.Args(seed=seed, out_dir=f"runs/bench_nudge_rl/{name}_s{seed}", **over))
            append_rows(CSV, "nudge_rl", "algos/nudge_rl.py", name, seed, s,
                        f"python algos/nudge_rl.py {flags(over)} --seed {seed}".replace("  ", " "))


def report() -> None:
    by = defaultdict(lambda: defaultdict(list))
    meta = None
    for r in read_rows(CSV):
        by[r["config"]][r["metric"]].append(float(r["value"]))
        meta = r
    lines = ["| configuration | rollouts / step | held-out acc start -> end (%) | gain (points) | all-fail prompts (%) | "
             "recovered by search / purification (%) | extra samples / step | wall (s) | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, over, label in CONFIGS:
        m = by.get(name)
        if not m:
            continue
        gain = [e - s for s, e in zip(m["eval_acc_start"], m["eval_acc_end"])]
        rec = m.get("p2o_recovered_frac") or m.get("lens_recovered_frac") or []
        G = over.get("group_size", 8)
        lines.append(f"| {label} (`{flags(over) or 'defaults'}`) | 16 x {G} | {mean_std(m['eval_acc_start'], 100)} -> "
                     f"{mean_std(m['eval_acc_end'], 100)} | {mean_std(gain, 100)} | "
                     f"{mean_std(m.get('all_fail_frac', []), 100)} | {mean_std(rec, 100) if rec else '-'} | "
                     f"{mean_std(m.get('extra_samples', []), 1, 0)} | {mean_std(m.get('wall_s', []), 1, 0)} | "
                     f"{len(m['eval_acc_end'])} |")
    if meta:
        lines += ["", "`algos/nudge_rl.py` defaults: tiny-0.6m on 2-digit `add`, 60 steps of 16 prompts, lr 2e-4, "
                      "held-out greedy accuracy of the bare prompt (`47+85=`) on 300 prompts (the noisy rows: the same "
                      "prompts with their distractor letters). The `units` hint is the scratchpad prompt with its first "
                      "column shown (`47+85:7+5=12;`), under which the tiny policy answers ~97% right. All-fail: "
                      "prompts whose 8 rollouts all fail, per step; recovered: the share of those for which the search "
                      "(P^2O) or the purified prompt (LENS) produced a success. Mean ± std over seeds. Hardware: "
                      f"{meta['hardware']}; {meta['versions']}; commit {meta['commit']}. Rows: "
                      f"`benchmarks/results/{CSV}`; command: `python benchmarks/nudge_rl_table.py`."]
    (RESULTS / "nudge_rl.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds)
    report()
