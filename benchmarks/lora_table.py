"""LoRA against full fine-tuning on the default GRPO task: held-out accuracy after the same rollout batches, and
what each trains.

    python benchmarks/lora_table.py                    # 2 arms x 3 seeds (about 10 minutes on 2 cores), table
    python benchmarks/lora_table.py --arms LoRA --seeds 0
    python benchmarks/lora_table.py --report-only      # rebuilds the table from the CSV

Arms, both algos/grpo.py on tiny-0.6m and 2-digit `add`, 32 prompts x 8 completions per batch, STEPS batches, the
default lr 1e-4, held-out greedy accuracy on 300 prompts at the start and the end:
  full fine-tuning   every weight trains (the default)
  LoRA rank 8        `--lora-rank 8` (alpha 16, adapters on every attention and MLP projection, the base frozen);
                     the KL reference, when asked for, is the same model with its adapters disabled
The peak memory of one SmolLM2-135M step under each is measured by `python benchmarks/memory_plan.py --measure-step
0` and `--measure-step 8` (benchmarks/results/lora_memory.csv) and listed beside the table.

Writes benchmarks/results/lora.csv (one row per run and metric) and lora.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "lora.csv", "lora"
SEEDS = (0, 1, 2)
STEPS = 30
COMMON = dict(steps=STEPS, eval_every=STEPS, eval_examples=300, pass_k=0, eval_hard=False, threads=1,
              prompts_per_step=32, group_size=8)
FLAGS = f"--steps {STEPS} --eval-every {STEPS} --eval-examples 300 --pass-k 0 --no-eval-hard --threads 1"
ARMS = {"full fine-tuning": ({}, ""), "LoRA rank 8": ({"lora_rank": 8}, " --lora-rank 8")}


def run(seeds, arms) -> None:
    from algos import grpo

    for seed in seeds:
        for label in arms:
            extra, flag = ARMS[label]
            exp = "lora" if extra else "full"
            s = grpo.main(grpo.Args(seed=seed, out_dir=f"runs/bench_lora/s{seed}", exp_name=exp, **COMMON, **extra))
            append_rows(CSV, NAME, "algos/grpo.py", label, seed, s, f"python algos/grpo.py {FLAGS} --seed {seed}{flag}")


def memory_lines() -> list[str]:
    """The measured SmolLM2-135M step (benchmarks/memory_plan.py --measure-step), when its rows exist."""
    by, _ = by_config_seed("lora_memory.csv")
    rows = {int(c.split("=")[1]): r["0"] for c, r in by.items()}
    if 0 not in rows or 8 not in rows:
        return []
    mib = lambda r: (r["state"] + r["update_peak"]) / 2 ** 20  # noqa: E731
    return ["", f"Memory, one steady-state GRPO update step of SmolLM2-135M on CPU in fp32 with a KL term (weights, "
            f"gradients, AdamW state and reference, plus the allocator's peak during the update; "
            f"`python benchmarks/memory_plan.py --measure-step 0` / `8`): full fine-tuning {mib(rows[0]):,.0f} MiB "
            f"({rows[0]['trainable'] / 1e6:.1f}M trainable), LoRA rank 8 {mib(rows[8]):,.0f} MiB "
            f"({rows[8]['trainable'] / 1e6:.2f}M trainable, no reference copy). Rows: "
            f"`benchmarks/results/lora_memory.csv`."]


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["| arm | held-out acc start | end | gain (points) | wall s | seeds |", "|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        gain = [r["eval_acc_end"] - r["eval_acc_start"] for r in runs.values()]
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(gain, 100)} | {mean_std(get('wall_s'), 1, 0)} | "
                     f"{len(runs)} |")
    row = next(iter(meta.values()))
    lines += ["", f"Held-out greedy accuracy in %, mean ± std over seeds: `algos/grpo.py` on tiny-0.6m, 2-digit `add`, "
              f"{STEPS} rollout batches of 32 prompts x 8 completions, lr 1e-4 for both arms, 300 held-out prompts. "
              f"LoRA: rank 8, alpha 16, every attention and MLP projection. Hardware: {row['hardware']} (shared); "
              f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/lora_table.py`.", *memory_lines()]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
