"""FP8 rollouts: train-inference mismatch against response length, and short reward curves with and without corrections.

    python benchmarks/fp8_rollout_table.py                  # mismatch (no training, about 3 min) + curves + tables
    python benchmarks/fp8_rollout_table.py --skip-train     # only the mismatch part
    python benchmarks/fp8_rollout_table.py --report-only    # rebuilds the tables from the CSV

Mismatch (FP8Engine and sample of algos/_fp8_engine.py, mismatch_metrics of algos/fp8_rollout.py; no training): the
shipped tiny-sums model on the long-response task (`sums<n>`, one-digit operands, responses of about 8n - 7
characters) for n = 2..6 operands, 32 prompts x 4 samples per (n, seed), 3 seeds. Rollout policies mu: fp32 (the same forward: plumbing only), bf16
(the whole copy), W8A8 FP8 (blockwise e4m3 linears), W8A8 + FP8 KV cache (e4m3, per-layer scales); trainers
pi_train: fp32, or for "unified" the same W8A8 + KV graph (Jet-RL). Figures per token: the exact KL(mu || pi_train)
over the vocabulary and |log pi_train - log mu|; per sequence: the std of sum_t log(pi_train / mu) (the log of the
sequence IS ratio). The spread exponent is the slope of log(spread) against log(mean length) over the five lengths
(0.5 if per-token errors were independent). Within one task (sums6, responses of about 41 tokens, the same prompts
and policy throughout) the exact KL per token by response position (0-7, 8-15, 16-31, 32+): whether the mismatch
grows with length where nothing but the position changes. Shared-Gumbel decoding: each W8A8 rollout re-decoded by the fp32 policy
from the same noise; first divergence, how often the reward is the same, and how often the two keep the order of a
pair of same-prompt rollouts that the FP8 rewards separate (Sol-RL's premise: the low-precision pool ranks as the
full-precision policy would; algos/fp8_sol_rl.py trains on that regeneration).

Training (--train is the default unless --skip-train): algos/fp8_rollout.py from tiny-sums on `sums` (5 operands,
max 48 new tokens), 20 rollout batches of 16 prompts x 8, held-out accuracy on 200 prompts every 10 batches, 3 seeds;
arms: fp32 rollouts, FP8 (W8A8 + KV) without correction, with token-TIS, and unified FP8 (no correction needed).

Writes benchmarks/results/fp8_rollout.csv and fp8_rollout.md.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std, read_rows, split_runs  # noqa: E402

CSV, NAME = "fp8_rollout.csv", "fp8_rollout"
SEEDS = (0, 1, 2)
OPERANDS = (2, 3, 4, 5, 6)
MODES = {"fp32": ("fp32", "off"), "bf16": ("bf16", "off"), "W8A8": ("fp8", "off"), "W8A8 + KV": ("fp8", "e4m3")}
ROWS = ("fp32", "bf16", "W8A8", "W8A8 + KV", "unified")  # unified: the W8A8 + KV rollouts against the unified trainer
SPREAD_ROWS = ("bf16", "W8A8", "W8A8 + KV")  # fp32 and unified spreads are rounding noise: no exponent
ARMS = {"fp32 rollouts": dict(rollout_dtype="fp32", correction="none"),
        "FP8, no correction": dict(kv_fp8="e4m3", correction="none"),
        "FP8, token-TIS": dict(kv_fp8="e4m3", correction="token-tis"),
        "unified FP8": dict(kv_fp8="e4m3", unified=True, correction="none")}
TRAIN = dict(model="tiny-sums", task="sums", digits=1, max_new_tokens=48, steps=20, prompts_per_step=16, group_size=8,
             eval_every=10, eval_examples=200, pass_k=0, eval_hard=False, threads=1, diag_every=5)
PROMPTS, SAMPLES = 32, 4
POSITIONS = ("0-7", "8-15", "16-31", "32+")  # algos/fp8_rollout.py's BUCKETS, as mismatch_metrics names them
POS_ROWS = ("bf16", "W8A8", "W8A8 + KV")
PLAN_RUNS = ((10, 19), (20, 29), (100, 241), (300, 322))  # the claims plan's fresh training runs


def pair_order(r_a, r_b, G: int) -> tuple[int, int]:
    """(pairs kept, pairs counted): same-prompt pairs that r_a orders strictly, and r_b orders the same way."""
    kept = counted = 0
    for g in range(0, len(r_a), G):
        for i in range(g, g + G):
            for j in range(i + 1, g + G):
                if r_a[i] != r_a[j]:
                    counted += 1
                    kept += (r_a[i] - r_a[j]) * (r_b[i] - r_b[j]) > 0
    return kept, counted


def run_mismatch(seeds) -> None:
    import numpy as np
    import torch

    import common
    from algos import _llm as llm
    from algos import fp8_rollout as f

    torch.set_num_threads(1)
    model, tok = common.load_model("tiny-sums")
    for seed in seeds:
        for n in OPERANDS:
            task = llm.make_task(f"sums{n}", 1)
            for label, (dtype, kv) in MODES.items():
                args = f.Args(model="tiny-sums", task=f"sums{n}", digits=1, max_new_tokens=48, rollout_dtype=dtype,
                              kv_fp8=kv, prompts_per_step=PROMPTS, group_size=SAMPLES, correction="none")
                engine = f.FP8Engine(model, args.rollout_dtype, args.kv_fp8, args.kv_scale)
                torch.manual_seed(1000 * seed + n)
                batch = f.rollout(model, tok, task, args, np.random.default_rng([seed, n]), "cpu", engine)
                rows = {label: f.mismatch_metrics(model, batch, engine, args)}
                if label == "W8A8 + KV":
                    rows["unified"] = f.mismatch_metrics(model, batch, engine, replace(args, unified=True))
                extra = {"length": batch["completion_mask"].float().sum(1).mean().item(),
                         "reward": batch["rewards"].mean().item()}
                if label == "W8A8":  # shared-Gumbel re-decoding by the fp32 policy (Sol-RL's proxy ranking)
                    examples = task.sample("train", PROMPTS, np.random.default_rng([seed, n]))  # rollout's prompts
                    answers = [e.answer for e in examples for _ in range(SAMPLES)]
                    extra.update(regen_agreement(model, tok, task, batch, args, f, answers))
                for row, m in rows.items():
                    figs = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("mismatch/")}
                    append_rows(CSV, "fp8_mismatch", "algos/fp8_rollout.py", f"{row} | sums{n}", seed, {**figs, **extra},
                                f"python benchmarks/fp8_rollout_table.py --skip-train --seeds {seed}")
            print(f"seed {seed} sums{n} done", flush=True)


def regen_agreement(model, tok, task, batch, args, f, answers) -> dict:
    """The W8A8 rollouts re-decoded by the fp32 trainer from the same noise: divergence, reward and rank agreement."""
    import torch

    B = batch["completion_ids"].shape[0]
    div = f.first_divergence(model, tok, batch, args, B)
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    ro, _, _ = f.sample(model, tok, prompts, 1, args.max_new_tokens, args.temperature, batch["noise"])
    r_fp8 = batch["rewards"].tolist()
    r_full = [task.verify(t, a)[0] for t, a in zip(ro.texts, answers)]
    kept, counted = pair_order(r_fp8, r_full, args.group_size)
    return {**{k.split("/", 1)[1]: v for k, v in div.items()},
            "same_reward_frac": float(torch.tensor([a == b for a, b in zip(r_fp8, r_full)]).float().mean()),
            "pair_order_kept": kept / max(counted, 1), "pairs_counted": counted}


def run_train(seeds, arms=tuple(ARMS)) -> None:
    from algos import fp8_rollout as f

    for seed in seeds:
        for label, kw in ARMS.items():
            if label not in arms:
                continue
            args = f.Args(**TRAIN, **kw, seed=seed, out_dir=f"runs/bench_fp8_rollout/s{seed}",
                          exp_name=label.replace(" ", "_").replace(",", ""))
            s = f.main(args)
            flags = " ".join(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
                             for k, v in {**TRAIN, **kw}.items() if not (isinstance(v, bool) and not v))
            append_rows(CSV, "fp8_train", "algos/fp8_rollout.py", label, seed, s,
                        f"python algos/fp8_rollout.py {flags} --no-eval-hard --seed {seed}")


def collect(bench: str):
    return by_config_seed(CSV, bench)


def vals(by, config: str, metric: str) -> list[float]:
    return [m[metric] for m in by.get(config, {}).values() if metric in m]


def exponent(by, row: str, seed: str):
    """Slope of log(sequence log-ratio spread) against log(mean length) over the lengths, for one seed."""
    xs, ys = [], []
    for n in OPERANDS:
        m = by.get(f"{row} | sums{n}", {}).get(seed)
        if m and m.get("seq_logratio_std", 0) > 0:
            xs.append(math.log(m["length"]))
            ys.append(math.log(m["seq_logratio_std"]))
    if len(xs) < 3:
        return None
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def report() -> None:
    by, meta = collect("fp8_mismatch")
    lines = []
    if by:
        lines += ["| mu vs pi_train | " + " | ".join(f"sums{n}: KL/token" for n in OPERANDS) +
                  " | mean abs dlogp (sums6) | max abs dlogp (sums6) | seq log-ratio std (sums2 -> sums6) | spread exponent |",
                  "|---|" + "---|" * (len(OPERANDS) + 4)]
        for row in ROWS:
            kl = [mean_std(vals(by, f"{row} | sums{n}", "exact"), 1e4, 2) for n in OPERANDS]
            last = f"{row} | sums{OPERANDS[-1]}"
            spread = (f"{mean_std(vals(by, f'{row} | sums{OPERANDS[0]}', 'seq_logratio_std'), 1, 3)} -> "
                      f"{mean_std(vals(by, last, 'seq_logratio_std'), 1, 3)}")
            seeds = sorted({s for n in OPERANDS for s in by.get(f"{row} | sums{n}", {})})
            exps = [e for e in (exponent(by, row, s) for s in seeds) if e is not None] if row in SPREAD_ROWS else []
            lines.append(f"| {row} | " + " | ".join(kl) + f" | {mean_std(vals(by, last, 'abs_dlogp_mean'), 1, 4)} | "
                         f"{mean_std(vals(by, last, 'abs_dlogp_max'), 1, 3)} | {spread} | {mean_std(exps, 1, 2)} |")
            if exps:
                for s, e in zip(seeds, exps):
                    append_rows_once(row, s, e)
        hi = f"sums{OPERANDS[-1]}"
        lines += ["", f"| mu vs pi_train, within {hi} | " + " | ".join(f"KL/token, positions {b}" for b in POSITIONS)
                  + " |", "|---|" + "---|" * len(POSITIONS)]
        for row in POS_ROWS:
            lines.append(f"| {row} | " + " | ".join(mean_std(vals(by, f"{row} | {hi}", f"kl_pos{b}"), 1e4, 2)
                                                     for b in POSITIONS) + " |")
        lens = " / ".join(mean_std(vals(by, f"W8A8 | sums{n}", "length"), 1, 1) for n in OPERANDS)
        lines += ["", "| W8A8 rollouts re-decoded by fp32 from the same noise | " +
                  " | ".join(f"sums{n}" for n in OPERANDS) + " |", "|---|" + "---|" * len(OPERANDS)]
        for metric, label, scale, digits in (("diverged_frac", "responses that diverge (%)", 100, 1),
                                             ("first_divergence", "first divergent token of those (mean position)", 1, 1),
                                             ("same_reward_frac", "same reward (%)", 100, 1),
                                             ("pair_order_kept", "reward order of separated pairs kept (%)", 100, 1)):
            lines.append(f"| {label} | " + " | ".join(mean_std(vals(by, f"W8A8 | sums{n}", metric), scale, digits)
                                                       for n in OPERANDS) + " |")
        row = next(iter(meta.values()))
        n_seeds = len(next(iter(by.values())))
        lines += ["", f"KL per token in units of 1e-4 (exact, over the 99-token vocabulary), mean ± std over {n_seeds} "
                  f"seeds of {PROMPTS} prompts x {SAMPLES} samples from tiny-sums (no training); mean response length "
                  f"{lens} tokens for sums2..sums6. mu: fp32 = the trainer's own forward through the KV cache, bf16 = "
                  f"the whole copy in bf16, W8A8 = e4m3 128x128 weight blocks and 1x128 activation tiles (output "
                  f"rounded to bf16), + KV = e4m3 KV cache with per-layer scales from the prefill; pi_train is fp32 "
                  f"except for unified (the W8A8 + KV graph with straight-through gradients). Spread exponent: slope of "
                  f"log std(sum_t log(pi/mu)) against log length per seed (0.5 = independent per-token errors; not fitted for fp32 "
                  f"and unified, whose spreads are rounding noise). Positions: the exact KL per token over the "
                  f"response tokens at those positions of the {hi} rollouts (the same responses, so the prompts, the "
                  f"policy and the task are fixed and only the length of the context changes). "
                  f"{row['versions']}; {row['hardware']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; "
                  f"command: `python benchmarks/fp8_rollout_table.py --skip-train`."]
    tby, tmeta = collect("fp8_train")
    runs = split_runs(tby, PLAN_RUNS)
    if tby:
        lines += [""] + train_table(runs[0][1])
        row = next(iter(tmeta.values()))
        lines += ["", f"`algos/fp8_rollout.py` from tiny-sums on `sums` (5 one-digit operands, at most 48 new tokens), "
                  f"{TRAIN['steps']} rollout batches of {TRAIN['prompts_per_step']} prompts x {TRAIN['group_size']}, lr "
                  f"1e-4, held-out greedy accuracy (%) on {TRAIN['eval_examples']} prompts with the trainer in fp32; "
                  f"train reward in %; KL and |dlogp| between mu and the trainer the run uses, measured every "
                  f"{TRAIN['diag_every']} batches. FP8 arms: W8A8 + e4m3 KV cache. Wall times are CPU simulation "
                  f"(FP8 is slower here, not faster). {row['hardware']} (shared); commit {row['commit']}. Rows: "
                  f"`benchmarks/results/{CSV}`; command: `python benchmarks/fp8_rollout_table.py`."]
        for (lo, hi), run in runs[1:]:
            lines += ["", f"Seeds {lo}-{hi}, a fresh run of the claims plan (benchmarks/claims_plan.csv) with the arms "
                      "it compares:", ""] + train_table(run)
    if by and tby:
        lines += ["", comparisons(by, runs[0][1])]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def train_table(tby) -> list[str]:
    lines = ["| arm | held-out acc start | end | best | train reward first | last | KL/token (1e-4) | "
             "mean abs dlogp | generated tokens/s | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        get = lambda k: vals(tby, label, k)  # noqa: E731
        if get("eval_acc_end"):
            lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | "
                         f"{mean_std(get('eval_acc_end'), 100)} | {mean_std(get('eval_acc_best'), 100)} | {mean_std(get('train_reward_first'), 100)} | "
                         f"{mean_std(get('train_reward_last'), 100)} | {mean_std(get('exact'), 1e4, 2)} | "
                         f"{mean_std(get('abs_dlogp_mean'), 1, 4)} | {mean_std(get('tokens_per_s'), 1, 0)} | "
                         f"{len(get('eval_acc_end'))} |")
    return lines


def comparisons(by, tby) -> str:
    """The comparisons the claims table judges, each described alone: the difference of seed means, its Welch 95%
    interval and where it lies (benchmarks/report.py's `describe_comparison`; the claims table gives the verdicts)."""
    from benchmarks.report import describe_comparison, t_interval

    def m(cfg, metric, b=by, scale=1.0):
        v = [scale * x for x in vals(b, cfg, metric)]
        return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else float("nan"), len(v)) if v else \
            (float("nan"), float("nan"), 0)

    def diff(a, b, digits=2):
        return describe_comparison("0~1", [a, b], digits)

    lo, hi = f"sums{OPERANDS[0]}", f"sums{OPERANDS[-1]}"
    kl = {r: m(f"{r} | {hi}", "exact", scale=1e4) for r in ROWS}
    exps = [e for e in (exponent(by, "W8A8", sd) for sd in by.get(f"W8A8 | {lo}", {})) if e is not None]
    exp_text = mean_std(exps, 1, 2)
    if len(exps) > 1:
        se = statistics.stdev(exps) / math.sqrt(len(exps))
        e_lo, e_hi = t_interval(statistics.mean(exps) - 0.5, se, len(exps) - 1)
        exp_text += (f" (minus 0.5, the exponent of independent per-token errors: {statistics.mean(exps) - 0.5:+.2f} "
                     f"[{e_lo:+.2f}, {e_hi:+.2f}])")
    acc = {a: m(a, "eval_acc_end", tby, 100.0) for a in ARMS}
    mixed = lambda sums, metric="exact": m(f"W8A8 + KV | {sums}", metric, scale=1e4)  # noqa: E731
    return (f"The comparisons the claims table judges, each described alone (difference of seed means, Welch's 95% "
            f"interval and where it lies; the verdicts, with their plans, fresh seeds and multiplicity step, are the "
            f"claims table's). Exact KL per token at {hi}, in 1e-4: W8A8 + KV minus W8A8 "
            f"{diff(kl['W8A8 + KV'], kl['W8A8'])}; W8A8 minus bf16 {diff(kl['W8A8'], kl['bf16'])}; bf16 minus unified "
            f"FP8 {diff(kl['bf16'], kl['unified'])}. W8A8 + KV at {hi} minus at {lo} "
            f"{diff(mixed(hi), mixed(lo))}; "
            f"within {hi}, positions {POSITIONS[-1]} minus positions {POSITIONS[0]} "
            f"{diff(mixed(hi, f'kl_pos{POSITIONS[-1]}'), mixed(hi, f'kl_pos{POSITIONS[0]}'))}. "
            f"The sequence log-ratio spread of W8A8 grows with the length with exponent {exp_text}. Held-out accuracy (%) after {TRAIN['steps']} batches, each arm minus fp32 rollouts: "
            f"token-TIS {diff(acc['FP8, token-TIS'], acc['fp32 rollouts'], 1)}; no correction "
            f"{diff(acc['FP8, no correction'], acc['fp32 rollouts'], 1)}; unified "
            f"{diff(acc['unified FP8'], acc['fp32 rollouts'], 1)}.")


def append_rows_once(row: str, seed: str, value: float) -> None:
    """The per-seed spread exponent as its own CSV row (what the claims table quotes), written when it changes."""
    have = [r for r in read_rows(CSV) if r["bench"] == "fp8_exponent" and r["config"] == row and r["seed"] == seed]
    if not have or abs(float(have[-1]["value"]) - value) > 1e-12:
        append_rows(CSV, "fp8_exponent", "algos/fp8_rollout.py", row, int(seed), {"spread_exponent": value},
                    "python benchmarks/fp8_rollout_table.py --skip-train")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables from the CSV")
    ap.add_argument("--skip-train", action="store_true", help="only the mismatch measurements (no training)")
    ap.add_argument("--skip-mismatch", action="store_true", help="only the training arms")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                    help="training arms to run (default: all)")
    a = ap.parse_args()
    if not a.report_only:
        if not a.skip_mismatch:
            run_mismatch(a.seeds)
        if not a.skip_train:
            run_train(a.seeds, a.arms)
    report()
