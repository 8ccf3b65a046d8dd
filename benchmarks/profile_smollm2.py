"""Where one GRPO step on a real model spends its time on CPU: SmolLM2-135M-Instruct, the pretrained benchmark's
setting (`benchmarks/run_pretrained.py`: --task words, 8 prompts x 4 completions of at most 48 tokens, temperature
0.7), phase by phase, and what each speed-up buys.

    python benchmarks/profile_smollm2.py --config fp32 --steps 3                 # one configuration, this code
    python benchmarks/profile_smollm2.py --config fp32 --code /path/to/old/tree  # the same harness on other code
    python benchmarks/profile_smollm2.py --report-only                           # rebuild smollm2_step.md

Each configuration builds the policy as algos/grpo.py does (llm.load_policy), then times `--steps` rollout batches
(grpo.rollout: generation + reward), updates (grpo.update: log-probs, backward, AdamW) and one greedy evaluation of
`--eval-examples` held-out problems; the first step is a warm-up and is not counted. One update is also run under
torch.profiler, and its ten most expensive operators (self CPU time) are written beside the timings. The step's
cost is generation + update + its share of evaluation: (eval-examples per evaluation / eval-every) problems per
step, at the pretrained benchmark's cadence of 100 problems every 10 steps.

Times are CPU seconds of the process (time.process_time) on one thread: on an idle core they equal wall seconds. They
are not a shield against other jobs: on two cores shared with eight other processes, the fp32 step's generation and
update took 2.8x and 3.6x the CPU seconds they take on an idle core (caches and memory bandwidth are shared too),
so measure on an idle machine.
Rows, the table and the operator profiles go to benchmarks/results/ (smollm2_step.*, one file each).
The first committed rows were measured on an idle Xeon with AVX-512 and AVX512-BF16 but no AMX (PyTorch's CPU
capability AVX512): there bf16 autocast is slower than fp32, in generation and in the update. The `epyc/` rows
(`--machine epyc`) were measured on an idle AMD EPYC with AVX-512 and AVX512-BF16 (capability AVX512 too), where a
bf16 matmul of the model's shapes runs about 4.8x faster than fp32 (530 vs 110 GFLOP/s on one thread) and bf16
autocast cuts the step 2.6x. The `epyc-b/` rows are the same kind of machine on another day, when the host ran
slower (one thread's fp32 matmul of the model's shapes: 90 instead of 110 GFLOP/s; bf16: 410 instead of 530), so the
baseline (fp32 at 64eccf4, through --code) was measured again beside the new configurations, interleaved with them.
The `epyc-c/` rows are a third day (the baseline's step 68.5 s against 61.5 s on the `epyc-b` day): fp32 at 64eccf4
twice, interleaved with --keep-freed-memory twice, at --steps 5 (a warm-up, three timed steps, the profiled one); the
row at 232463a is the flag's first version, which only raised glibc's mapping threshold to its 32 MiB maximum, so an
update's 75 MiB [positions x vocab] blocks still faulted.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (grpo.py flags, evaluated problems per training step at that configuration's cadence, what it changes)
CONFIGS = {
    "fp32": (["--dtype", "fp32", "--micro-batch-size", "8"], 10.0,
             "the pretrained benchmark's setting: fp32, micro-batches of 8, 100 problems every 10 steps"),
    "bf16": (["--dtype", "bf16", "--micro-batch-size", "8"], 10.0, "bf16 autocast (fp32 weights, AdamW and losses)"),
    "bf16-mb32": (["--dtype", "bf16", "--micro-batch-size", "32"], 10.0,
                  "bf16, the whole batch of 32 in one micro-batch (4 prompts' groups share each prompt pass)"),
    "bf16-eval20": (["--dtype", "bf16", "--micro-batch-size", "8"], 5.0,
                    "bf16, 100 held-out problems every 20 steps instead of every 10 (the final evaluation unchanged: "
                    "a run always evaluates at its last step)"),
    "bf16-eval20-attn32-fused": (["--dtype", "bf16", "--micro-batch-size", "8", "--attention-fp32", "--fused-adamw"],
                                 5.0, "bf16-eval20, with attention in fp32 (--attention-fp32: on CPU the bf16 "
                                 "flash-attention kernel is the slower one) and AdamW's fused kernel (--fused-adamw)"),
    "bf16-eval20-attn32-fused-icdf": (["--dtype", "bf16", "--micro-batch-size", "8", "--attention-fp32",
                                       "--fused-adamw", "--inverse-cdf-sampling"], 5.0,
                                      "bf16-eval20-attn32-fused, each sampled token drawn by inverse CDF "
                                      "(--inverse-cdf-sampling) instead of torch.multinomial's exponential per "
                                      "vocabulary entry"),
    "bf16-eval20-attn32-fused-keep": (["--dtype", "bf16", "--micro-batch-size", "8", "--attention-fp32",
                                       "--fused-adamw", "--keep-freed-memory"], 5.0,
                                      "bf16-eval20-attn32-fused, with freed memory kept by the process "
                                      "(--keep-freed-memory: no page faults for the [rows x vocab] tensors of "
                                      "each decoding step and update)"),
}
BASE = ["--model", "smollm2-135m", "--task", "words", "--max-new-tokens", "48", "--prompts-per-step", "8",
        "--group-size", "4", "--temperature", "0.7", "--lr", "1e-5", "--pass-k", "0", "--no-eval-hard"]
CSV = "smollm2_step.csv"
BASELINE = "fp32@64eccf4"  # the step before any of the speed-ups: each machine's speed-ups are taken against it


def measure(config: str, steps: int, eval_examples: int, threads: int, code: Path) -> dict:
    """Time each phase of `steps` GRPO steps (the first a warm-up) on the code tree `code`; profile one update."""
    sys.path.insert(0, str(code))
    import numpy as np
    import torch
    import tyro
    from torch.profiler import ProfilerActivity, profile

    import common
    from algos import _llm as llm
    from algos import grpo

    flags, _, _ = CONFIGS[config]
    args = tyro.cli(grpo.Args, args=[*BASE, *flags, "--threads", str(threads), "--eval-examples", str(eval_examples),
                                     "--out-dir", "/tmp/profile_smollm2", "--exp-name", config])
    run = llm.Run(args)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    opt = llm.make_optimizer(model.parameters(), args)
    gen, train, tokens = [], [], []  # CPU seconds of this process (see the module docstring)
    for step in range(1, steps + 1):
        torch.manual_seed(step)
        rng = np.random.default_rng([0, step])
        t0 = time.process_time()
        batch = grpo.rollout(sampler, tok, run.task, args, rng, run.accel.device)
        t1 = time.process_time()
        if step == steps:  # the last update under the profiler (its time is not counted)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                grpo.update(model, opt, batch, grpo.grpo_loss, args, step, run.accel, sampler, ref_model)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
            break
        grpo.update(model, opt, batch, grpo.grpo_loss, args, step, run.accel, sampler, ref_model)
        t2 = time.process_time()
        print(f"{config} step {step}: generation {t1 - t0:.1f} s, update {t2 - t1:.1f} s", flush=True)
        if step > 1:
            gen.append(t1 - t0)
            train.append(t2 - t1)
            tokens.append(int(batch["completion_mask"].sum()))
    t0 = time.process_time()
    acc = common.evaluate(sampler, tok, run.task, run.eval_sets["main"], args.max_new_tokens)["acc"]
    eval_per_problem = (time.process_time() - t0) / eval_examples
    return {"gen_s": statistics.mean(gen), "train_s": statistics.mean(train), "eval_s_per_problem": eval_per_problem,
            "gen_tokens": statistics.mean(tokens), "eval_acc": acc, "profile": table}


def report() -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks._results import read_rows

    rows = read_rows(CSV)
    if not rows:
        return ""
    runs = {}  # label -> metric -> one value per measurement: a label measured again is averaged, its count shown
    for r in rows:
        runs.setdefault(r["bench"], {}).setdefault(r["metric"], []).append(float(r["value"]))
    by = {name: {k: statistics.mean(v) for k, v in m.items()} for name, m in runs.items()}
    lines = ["# One GRPO step of SmolLM2-135M-Instruct on CPU", "",
             "Phases of one step at the pretrained benchmark's setting (`benchmarks/run_pretrained.py`), measured by "
             "`benchmarks/profile_smollm2.py` (mean of the timed steps after a warm-up; evaluation per problem from "
             "one greedy pass over the held-out problems), in CPU seconds of one thread. step = generation + update + "
             "evaluated problems per step x evaluation per problem.", "",
             f"Rows are grouped by machine; a row's speed-up is against its machine's `{BASELINE}` row (the step before "
             "the speed-ups; else the machine's first row). A configuration measured more than once shows the mean of "
             "its measurements (runs).", "",
             "| machine | configuration | code | runs | generation (CPU s) | update (CPU s) | eval per problem (CPU s) | "
             "eval problems per step | step (CPU s) | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    prof = ROOT / "benchmarks" / "results" / "smollm2_step_profile.txt"
    matmul = matmul_seconds(prof.read_text()) if prof.exists() else {}
    steps = {name: m["gen_s"] + m["train_s"] + m["eval_per_step"] * m["eval_s_per_problem"] for name, m in by.items()}
    firsts = {}  # machine -> its baseline's step
    for name in sorted(by, key=lambda n: machine_of(n)[1] != BASELINE):  # a machine's baseline row first, if any
        firsts.setdefault(machine_of(name)[0], steps[name])
    for name, m in by.items():
        step, (machine, row) = steps[name], machine_of(name)
        first = firsts[machine]
        config, code = row.split("@")[0], row.split("@")[-1]
        lines.append(f"| {machine} | {config} | {code} | {len(runs[name]['gen_s'])} | {m['gen_s']:.1f} | "
                     f"{m['train_s']:.1f} | {m['eval_s_per_problem']:.2f} | {m['eval_per_step']:.0f} | {step:.1f} | "
                     f"{first / step:.2f}x |")
    lines += ["", "Configurations:", ""] + sorted({f"- `{c}`: {CONFIGS[c][2]}" for n in by
                                                   if (c := machine_of(n)[1].split("@")[0]) in CONFIGS})
    if prof.exists():
        lines += ["", f"Top operators of one update per configuration: `benchmarks/results/{prof.name}`."]
    if firsts and matmul:  # how far the update can go at its matmuls' measured speed
        lines += ["", "Matrix multiplies (`aten::mm`, self CPU seconds of the profiled update) and the step if everything "
                  "else in the update cost nothing, generation and evaluation unchanged:", ""]
        for name, m in by.items():
            if name in matmul:
                bound = steps[name] - m["train_s"] + matmul[name]
                lines.append(f"- `{name}`: {matmul[name]:.1f} s of {m['train_s']:.1f} s; step at least {bound:.1f} s, "
                             f"at most {firsts[machine_of(name)[0]] / bound:.2f}x its machine's baseline")
    return "\n".join(lines) + "\n"


def machine_of(name: str) -> tuple[str, str]:
    """'epyc/fp32@64eccf4' -> ('epyc', 'fp32@64eccf4'); a row without a machine prefix was measured on the first
    machine, an Intel Xeon with AVX-512 and AVX512-BF16 but no AMX."""
    return tuple(name.split("/", 1)) if "/" in name else ("xeon", name)


def matmul_seconds(profile_text: str) -> dict:
    """{row label: self CPU seconds of aten::mm} from the profile file's '## label' sections."""
    out, label = {}, None
    for line in profile_text.splitlines():
        if line.startswith("## "):
            label = line[3:].split(" (")[0]
        elif label and line.split()[:1] == ["aten::mm"]:
            v = line.split()[2]
            out[label] = float(v[:-2]) / 1000 if v.endswith("ms") else float(v.rstrip("s"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=list(CONFIGS), default="fp32", help="what to measure (see CONFIGS)")
    ap.add_argument("--code", type=Path, default=ROOT, help="code tree to measure (default: this one)")
    ap.add_argument("--label", default="", help="name of the row (default: the config, @ the code's commit)")
    ap.add_argument("--machine", default="", help="machine name the row is grouped under (MACHINE/ before the label; "
                    "speed-ups are only taken between rows of one machine)")
    ap.add_argument("--steps", type=int, default=3, help="rollout batches; the first is a warm-up, the last profiled")
    ap.add_argument("--eval-examples", type=int, default=20, help="held-out problems timed for the evaluation")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: its CPU seconds are the wall seconds of an idle core)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the table from the CSV")
    a = ap.parse_args()
    if not a.report_only:
        if a.steps < 3:
            raise SystemExit("--steps must be at least 3: a warm-up, a timed step and the profiled one")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=a.code, capture_output=True,
                                text=True).stdout.strip()
        m = measure(a.config, a.steps, a.eval_examples, a.threads, a.code.resolve())
        label = (f"{a.machine}/" if a.machine else "") + (a.label or f"{a.config}@{commit}")
        sys.path.insert(0, str(ROOT))
        from benchmarks._results import RESULTS, append_rows

        append_rows(CSV, label, "algos/grpo.py", "smollm2-135m words", 0,
                    {k: m[k] for k in ("gen_s", "train_s", "eval_s_per_problem", "gen_tokens", "eval_acc")} |
                    {"eval_per_step": CONFIGS[a.config][1]},
                    command=f"python benchmarks/profile_smollm2.py --config {a.config} --steps {a.steps} "
                            f"--eval-examples {a.eval_examples} --threads {a.threads}")
        with open(RESULTS / "smollm2_step_profile.txt", "a") as f:
            f.write(f"## {label} (threads {a.threads})\n{m['profile']}\n")
        print({k: v for k, v in m.items() if k != "profile"})
    table = report()
    if table:
        (ROOT / "benchmarks" / "results" / "smollm2_step.md").write_text(table)


if __name__ == "__main__":
    main()
