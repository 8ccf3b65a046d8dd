"""Speculative rollouts: measured tokens per target call against (1 - alpha^(gamma+1)) / (1 - alpha), the
batched target-call reduction and the wall-clock ratio against HF `generate` (KV cache), per drafter and gamma;
then short GRPO runs of algos/spec_rl.py per drafter (acceptance drift, reuse, target forwards per token).

    python benchmarks/bench_spec_rollout.py                 # runs everything, seed 0 (15 minutes on 2 cores)
    python benchmarks/bench_spec_rollout.py --seeds 0 1 2   # three seeds (about 45 minutes)
    python benchmarks/bench_spec_rollout.py --report-only   # rebuilds the table and plot from the CSV
    python benchmarks/report.py                             # puts the table into benchmarks/README.md

Writes benchmarks/results/spec_rollout.csv (rows with provenance), spec_rollout.md and spec_speedup.png. The tables
give the mean ± std over the seeds of each configuration (the latest row per seed); ratios against `none` are taken
per seed. The seed draws the prompts (spec_decode) and the whole run (spec_rl).
No GPU in the session that made the committed rows: wall-clock figures are CPU figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, fresh_run_tables, read_rows, split_runs  # noqa: E402

CSV = "spec_rollout.csv"
DECODE = [("model", 2), ("model", 4), ("model", 6), ("ngram", 4), ("ngram", 8)]
RL_DRAFTERS = ["none", "prev", "prev+ngram", "ngram", "model", "self"]
PLAN_RUNS = ((20, 26),)  # the claims plan's fresh run (benchmarks/claims_plan.csv)
RL_POOL = 128  # a small pool: many epochs in a short run, so SPEC-RL has previous rollouts to reuse


def run(rl_steps: int, decode: bool = True, rl_drafters=RL_DRAFTERS, seeds=(0,), decode_configs=DECODE) -> None:
    from algos import spec_decode, spec_rl

    for seed in seeds:
        for drafter, gamma in decode_configs if decode else []:
            a = spec_decode.Args(drafter=drafter, gamma=gamma, waves=2 if drafter == "ngram" else 1, prompts=16,
                                 seed=seed, out_dir="runs/bench_spec", exp_name=f"{drafter}_g{gamma}_s{seed}")
            s = spec_decode.main(a)
            append_rows(CSV, "spec_decode", "algos/spec_decode.py", f"{drafter} gamma={gamma} addsteps tiny-5m", seed, s,
                        f"python algos/spec_decode.py --drafter {drafter} --gamma {gamma} --prompts 16"
                        + (" --waves 2" if drafter == "ngram" else "") + f" --seed {seed}")
        for drafter in rl_drafters:
            a = spec_rl.Args(drafter=drafter, steps=rl_steps, eval_every=rl_steps, pool_size=RL_POOL, seed=seed,
                             out_dir="runs/bench_spec", exp_name=f"rl_{drafter.replace('+', '_')}_s{seed}")
            s = spec_rl.main(a)
            append_rows(CSV, "spec_rl", "algos/spec_rl.py", f"{drafter} steps={rl_steps}", seed, s,
                        f"python algos/spec_rl.py --drafter {drafter} --steps {rl_steps} --eval-every {rl_steps} "
                        f"--pool-size {RL_POOL} --seed {seed}")


def latest(rows):
    """{(bench, config): {seed: {metric: value, '_meta': row}}}, the latest row per (bench, config, seed, metric)."""
    by = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by[(r["bench"], r["config"])][r["seed"]][r["metric"]] = float(r["value"])
        by[(r["bench"], r["config"])][r["seed"]]["_meta"] = r
    return by


def ms(vals, digits: int, suffix: str = "") -> str:
    """'mean ± std' over seeds (sample std), or the value alone for one seed."""
    vals = [v for v in vals if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}{suffix}"
    return f"{statistics.mean(vals):.{digits}f}{suffix} ± {statistics.stdev(vals):.{digits}f}"


def report() -> None:
    from algos._speculative import speedup_theory, tokens_per_call_theory

    parts = split_runs(latest(read_rows(CSV)), PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    lines = ["**Speculative sampling** (`algos/spec_decode.py`, target `tiny-5m`, `addsteps`, 16 prompts x 8, "
             "T = 1). Tokens per call are per sequence (emitted tokens / target forwards the sequence took part "
             "in); batched calls are the lock-step batch's target forwards; wall ratio = HF `generate` time / "
             "speculative time on the same prompts. **CPU only: no GPU was available for these rows.**", "",
             "| drafter | gamma | alpha | tokens / call (measured) | theory (1-a^(g+1))/(1-a) | batched calls: "
             "plain -> spec | call reduction | wall ratio (CPU) | seeds |", "|---|---|---|---|---|---|---|---|---|"]
    meta = None
    for (bench, cfg), per in sorted(by.items()):
        if bench != "spec_decode":
            continue
        runs = list(per.values())
        meta = runs[-1]["_meta"]
        drafter, gamma = cfg.split()[0], int(cfg.split()[1].split("=")[1])
        col = lambda k: [f[k] for f in runs]  # noqa: E731
        lines.append(f"| {drafter} | {gamma} | {ms(col('alpha'), 3)} | {ms(col('tokens_per_row_call'), 2)} | "
                     f"{ms([tokens_per_call_theory(f['alpha'], gamma) for f in runs], 2)} | "
                     f"{ms(col('plain_calls'), 0)} -> {ms(col('target_calls'), 0)} | {ms(col('call_reduction'), 2, 'x')} | "
                     f"{ms(col('speedup_wall'), 2, 'x')} | {len(runs)} |")
    lines += ["", f"**GRPO with speculative rollouts** (`algos/spec_rl.py`, policy `tiny-0.6m`, `add`, fixed pool "
              f"of {RL_POOL} prompts, 32 x 8 per step, the same seeds for every drafter). Forwards / token = per-sequence target forwards "
              "per generated token (plain = 1); call reduction = batched target calls of `none` / this drafter; "
              "rollout time ratio = rollout seconds of `none` / this drafter (CPU); alpha early / late = mean "
              "acceptance over the first / last tenth of the run after epoch 0.", "",
              "| drafter | steps | held-out acc start -> end | forwards / token | batched calls / step | call "
              "reduction | rollout time ratio (CPU) | reused | alpha early -> late | seeds |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rl = {cfg: per for (bench, cfg), per in by.items() if bench == "spec_rl"}
    for cfg, per in sorted(rl.items(), key=lambda kv: (RL_DRAFTERS.index(kv[0].split()[0]), kv[0])):
        base = rl.get("none " + cfg.split()[1], {})
        runs = list(per.values())
        meta = runs[-1]["_meta"]
        col = lambda k, scale=1.0: [scale * f[k] for f in runs]  # noqa: E731
        red = [base[sd]["target_calls"] / f["target_calls"] for sd, f in per.items() if sd in base]
        tr = [base[sd]["gen_s"] / f["gen_s"] for sd, f in per.items() if sd in base]
        lines.append(f"| {cfg.split()[0]} | {cfg.split()[1].split('=')[1]} | {ms(col('eval_acc_start', 100), 1)} -> "
                     f"{ms(col('eval_acc_end', 100), 1)} | {ms(col('row_calls_per_token'), 3)} | "
                     f"{ms(col('target_calls_per_step'), 2)} | {ms(red, 2, 'x')} | {ms(tr, 2, 'x')} | "
                     f"{ms(col('reused_frac'), 2)} | {ms(col('alpha_early'), 3)} -> {ms(col('alpha_late'), 3)} | "
                     f"{len(runs)} |")
    commits = ", ".join(sorted({f["_meta"]["commit"] for per in by.values() for f in per.values()}))
    if meta:
        lines += ["", f"Hardware: {meta['hardware']} (shared with other jobs, so wall times are noisy); "
                  f"{meta['versions']}; commits {commits}. Rows: `benchmarks/results/{CSV}`; command: "
                  "`python benchmarks/bench_spec_rollout.py`."]
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("forwards / token", "row_calls_per_token", 1, 3),
            ("reused", "reused_frac", 1, 2), ("alpha early", "alpha_early", 1, 3), ("alpha late", "alpha_late", 1, 3)]
    name = lambda part: {f"{cfg} ({bench})": d for (bench, cfg), d in part.items()}  # noqa: E731
    lines += fresh_run_tables([(r, name(p)) for r, p in parts[1:]], cols)
    (RESULTS / "spec_rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.5, 4))
    a = np.linspace(0, 0.99, 100)
    for g in (2, 4, 6, 8):
        ax.plot(a, [tokens_per_call_theory(x, g) for x in a], "--", lw=1, label=f"theory tokens/call, gamma={g}")
    ax.plot(a, [speedup_theory(x, 4, 0.3) for x in a], ":", color="k", lw=1, label="theory speedup, gamma=4, c=0.3")
    for (bench, cfg), per in by.items():
        if bench == "spec_decode":
            f = {k: statistics.mean(r[k] for r in per.values()) for k in ("alpha", "tokens_per_row_call", "speedup_wall")}
            ax.scatter(f["alpha"], f["tokens_per_row_call"], marker="o", color="C0")
            ax.scatter(f["alpha"], f["speedup_wall"], marker="x", color="C3")
            ax.annotate(cfg.split(" add")[0], (f["alpha"], f["tokens_per_row_call"]), fontsize=7)
    ax.scatter([], [], marker="o", color="C0", label="measured tokens / target call")
    ax.scatter([], [], marker="x", color="C3", label="measured wall-clock speedup (CPU)")
    ax.set(xlabel="acceptance alpha", ylabel="tokens per call / speedup", title="Speculative sampling vs alpha")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(RESULTS / "spec_speedup.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table and plot from the CSV")
    ap.add_argument("--rl-steps", type=int, default=32, help="GRPO rollout batches per drafter")
    ap.add_argument("--rl-drafters", nargs="+", default=RL_DRAFTERS, choices=RL_DRAFTERS, help="spec_rl drafters")
    ap.add_argument("--no-decode", action="store_true", help="skip the spec_decode sweep")
    ap.add_argument("--decode", nargs="+", default=None, help="spec_decode configurations as drafter:gamma "
                    "(default: all of DECODE)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    if not args.report_only:
        dec = DECODE if args.decode is None else [(d.split(":")[0], int(d.split(":")[1])) for d in args.decode]
        run(args.rl_steps, not args.no_decode, args.rl_drafters, args.seeds, dec)
    report()
