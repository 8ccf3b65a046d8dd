"""AsyncOPD: student accuracy vs rollout staleness per loss, and the teacher-cache bias/variance.

Paper: "AsyncOPD: How Stale Can On-Policy Distillation Be?", arXiv:2606.24143.

    python benchmarks/async_opd_staleness.py                  # about 12 minutes per seed on 2 shared cores
    python benchmarks/async_opd_staleness.py --only cache --seeds 0 1 2   # part 2 only, 3 seeds (about a minute)
    python benchmarks/async_opd_staleness.py --report-only    # rebuild the table from the committed CSV
    python benchmarks/async_opd_staleness.py --plan --seeds 10 11 12 13 14 15 16 17 18   # the claims plan's run
    python benchmarks/async_opd_staleness.py --only train --arms "rkl-recompute|k=8" "rkl-stale|k=8" --seeds 100
    python benchmarks/report.py                               # paste it into benchmarks/README.md

Part 1: algos/async_opd.py for variants fkl, rkl-stale, rkl-recompute, rkl-mc at staleness k in {0, 2, 8}.
Part 2: on one real batch per seed (tiny-0.6m rollouts of that seed's prompts, scored by tiny-5m), the relative
bias and variance of the per-position reverse-KL gradient estimators: sparse top-k for several k, 1-sample and
4-sample Monte Carlo (the seed draws the prompts, the rollouts and the Monte-Carlo samples).
The Monte-Carlo rows' raw bias (squared distance of the mean of n = DRAWS draws from the exact gradient)
contains the noise floor Var/n that even an unbiased estimator keeps; the table also gives the bias net of it,
raw - Var_hat/(n - 1), computed from the rows' rel_bias, rel_var and draws (rows without a `draws` figure were
made with DRAWS draws).
--plan: part 2 at the fresh seeds that benchmarks/claims_plan.csv asks for, under the bench `async_opd_cache_plan`
and in a table of its own, so that they neither pool with the first runs' seeds nor stand in for them.
Rows: benchmarks/results/async_opd.csv; table: benchmarks/results/async_opd.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows, mean_std, seed_ranges  # noqa: E402

CSV = "async_opd.csv"
VARIANTS = ("fkl", "rkl-stale", "rkl-recompute", "rkl-mc")
STALENESS = (0, 2, 8)
STEPS, EVAL = 40, 300
DRAWS, CACHE_PROMPTS = 256, 64  # part 2: draws per MC estimator, rollouts in the batch
PLAN = "async_opd_cache_plan"  # --plan: the bench of the claims plan's fresh part-2 seeds


ARMS = [f"{variant}|k={k}" for variant in VARIANTS for k in STALENESS]  # part 1's runs, as their rows name them


def run(seeds, parts=("train", "cache"), cache_bench: str = "async_opd_cache", arms=tuple(ARMS)) -> None:
    from algos import async_opd as ao

    for seed in seeds if "train" in parts else []:
        for variant in VARIANTS:
            for k in STALENESS:
                if f"{variant}|k={k}" not in arms:
                    continue
                s = ao.main(ao.Args(seed=seed, variant=variant, staleness=k, steps=STEPS, eval_every=STEPS,
                                    eval_examples=EVAL, out_dir=f"runs/bench_async_opd/{variant}_k{k}_s{seed}"))
                append_rows(CSV, "async_opd", "algos/async_opd.py", f"{variant}|k={k}", seed, s,
                            f"python algos/async_opd.py --variant {variant} --staleness {k} --steps {STEPS} --seed {seed}")
    for seed in seeds if "cache" in parts else []:
        for r in cache_rows(seed=seed):
            append_rows(CSV, cache_bench, "algos/async_opd.py", f"{r['estimator']}|k={r['k']}|M={r['M']}", seed,
                        {m: r[m] for m in ("rel_bias", "rel_var", "draws")},
                        f"python benchmarks/async_opd_staleness.py --only cache --seeds {seed} (cache_bias_variance)")


def cache_rows(draws: int = DRAWS, n_prompts: int = CACHE_PROMPTS, seed: int = 0) -> list[dict]:
    """Part 2: estimator bias and variance on one real batch (tiny-0.6m rollouts, tiny-5m scores); `seed` draws
    the prompts, the rollouts and the Monte-Carlo samples (seed 0: the batch of the first committed rows)."""
    import numpy as np
    import torch

    import common
    from algos import _llm as llm
    from algos import async_opd as ao

    torch.manual_seed(seed)
    student, tok = common.load_model("tiny-0.6m")
    teacher, _ = common.load_model("tiny-5m")
    task = llm.make_task("add")
    exs = task.sample("train", n_prompts, np.random.default_rng(seed))
    ro = common.generate(student, tok, common.encode_prompts(tok, [e.prompt for e in exs]), 1, 8)
    b = {k: getattr(ro, k) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    with torch.no_grad():
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
        mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        h = student.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        s_logits = student.get_output_embeddings()(h[:, b["prompt_ids"].shape[1] - 1:-1])
        t_logp = ao.chunk_logprobs(teacher, ao.completion_hidden(teacher, **b))  # [B, C, V] of the 99-token tiny model
    keep = b["completion_mask"].bool()
    return ao.cache_bias_variance(s_logits[keep], t_logp[keep], ks=(1, 4, 16, 0), mc=(1, 4), draws=draws,
                                 seed=seed)


def net_of_noise(rel_bias: float, rel_var: float, draws: float) -> float:
    """bias^2 net of the noise floor: E[rel_bias] = bias^2 + Var/n and E[rel_var] = Var (n - 1)/n, so
    rel_bias - rel_var/(n - 1) estimates bias^2 without bias (as cache_bias_variance's rel_bias_net)."""
    return rel_bias - rel_var / max(draws - 1, 1)


def signed(vals: list[float]) -> str:
    m = statistics.mean(vals)
    return f"{m:+.4f}" if len(vals) == 1 else f"{m:+.4f} ± {statistics.stdev(vals):.4f}"


def cache_table(by: dict) -> list[str]:
    """The part-2 table from {config: {metric: [values]}}."""
    lines = ["| estimator (one real batch per seed) | cache k | samples M | relative bias² (raw) | relative variance | "
             "relative bias² net of noise | seeds |", "|---|---|---|---|---|---|---|"]
    for config, f in by.items():
        if "rel_bias" not in f:
            continue
        est, k, m = config.split("|")
        draws = f["draws"] if len(f.get("draws", [])) == len(f["rel_bias"]) else [DRAWS] * len(f["rel_bias"])
        net = [net_of_noise(b, v, d) for b, v, d in zip(f["rel_bias"], f["rel_var"], draws)]
        lines.append(f"| {est} | {k[2:] if est.startswith('sparse') else '-'} | {m[2:] if m != 'M=0' else '-'} | "
                     f"{mean_std(f['rel_bias'], 1, 4)} | {mean_std(f['rel_var'], 1, 3)} | "
                     f"{signed(net)} | {len(f['rel_bias'])} |")
    return lines


def fmt(vals, scale=100.0):
    return mean_std(vals, scale)


def report() -> None:
    rows = read_rows(CSV)
    latest = {(r["bench"], r["config"], r["metric"], r["seed"]): float(r["value"]) for r in rows}  # a later row wins
    # part 1's table compares the runs on the seeds they all ran; seeds only some ran (`--arms`) get their own table
    ran = [{s for (b, c, _, s) in latest if b == "async_opd" and c == arm} for arm in ARMS]
    shared = set.intersection(*[seeds for seeds in ran if seeds]) if any(ran) else set()
    by, fresh = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    fresh_train = defaultdict(lambda: defaultdict(list))
    for (bench, config, metric, seed), v in latest.items():
        part = fresh_train if bench == "async_opd" and seed not in shared else fresh if bench == PLAN else by
        part[config][metric].append(v)
    meta, meta_cache = None, None
    for r in rows:
        if r["bench"] == "async_opd" and r["seed"] in shared:
            meta = r
        elif r["bench"] not in (PLAN, "async_opd"):
            meta_cache = r
    lines = ["| variant | acc k=0 | acc k=2 | acc k=8 | KL(s‖t) k=0 | KL(s‖t) k=2 | KL(s‖t) k=8 |",
             "|---|---|---|---|---|---|---|"]
    start = []
    for v in VARIANTS:
        cells = [by.get(f"{v}|k={k}", {}) for k in STALENESS]
        if not any(cells):
            continue
        for c in cells:
            start += c.get("eval_acc_start", [])
        accs = [fmt(c.get("eval_acc_end", [])) for c in cells]
        kls = [f"{statistics.mean(c['kl_reverse_end']):.3f}" if c.get("kl_reverse_end") else "-" for c in cells]
        lines.append(f"| `{v}` | " + " | ".join(accs + kls) + " |")
    lines += [""] + cache_table(by)
    if meta:
        seeds = len(by[f"{VARIANTS[0]}|k=0"]["eval_acc_end"]) if by.get(f"{VARIANTS[0]}|k=0") else 0
        lines += ["", f"Top: `algos/async_opd.py`, student `tiny-0.6m` (held-out start {fmt(start)}%), teacher `tiny-5m`, "
                  f"2-digit addition, {STEPS} steps (32 prompts x 4; reduced from the 120-step default for the budget), "
                  f"lr 1e-4, full teacher scores (no cache); accuracy = held-out greedy % on {EVAL} prompts at the end; "
                  f"KL = mean exact per-token KL(student‖teacher) on the last 10 batches. Staleness k: rollouts sampled "
                  f"by the student of k updates ago. {seeds} seed(s); differences of a few points are within noise at "
                  f"this size. Bottom: per-position gradient (w.r.t. the student logits) of KL(student‖teacher), "
                  f"bias² and variance relative to the exact gradient's squared norm, over all completion positions of "
                  f"{CACHE_PROMPTS} student rollouts (99-token vocabulary; k = 99 is the full vocabulary; {DRAWS} draws "
                  f"per MC estimator, sampled from the student at the rollout's own prefixes, so no staleness). Raw "
                  f"bias² = squared distance of the mean of the {DRAWS} draws from the exact gradient: for an MC "
                  f"estimator it includes the noise floor Var/{DRAWS}; net of noise = raw − variance/({DRAWS} − 1), "
                  f"an unbiased estimate of the squared bias, which scatters around 0 for an unbiased estimator. "
                  f"Hardware: {meta['hardware']}; {meta['versions']}; commit {meta['commit']}"
                  + (f" (bottom: commit {meta_cache['commit']})" if meta_cache and
                     meta_cache["commit"] != meta["commit"] else "") + ". "
                  f"Rows: `benchmarks/results/{CSV}`; command: `python benchmarks/async_opd_staleness.py`."]
    if fresh_train:
        seeds = seed_ranges({s for (b, _, _, s) in latest if b == "async_opd" and s not in shared})
        lines += ["", f"Seeds {seeds} of part 1, which only these runs ran (a fresh run of the claims "
                  "plan, `--arms`):", "", "| variant | staleness k | acc | KL(s‖t) | seeds |", "|---|---|---|---|---|"]
        for config, f in fresh_train.items():
            v, k = config.split("|")
            lines.append(f"| `{v}` | {k[2:]} | {fmt(f['eval_acc_end'])} | {statistics.mean(f['kl_reverse_end']):.3f} | "
                         f"{len(f['eval_acc_end'])} |")
    if fresh:
        seeds = sorted({int(s) for (b, _, _, s) in latest if b == PLAN})
        lines += ["", f"The claims plan's fresh run of part 2 (`--plan`, seeds {seeds[0]}-{seeds[-1]}):", ""]
        lines += cache_table(fresh)
    (RESULTS / "async_opd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", choices=["train", "cache"], default=None, help="run one of the two parts")
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS, metavar="VARIANT|k=K",
                    help="part 1's runs (default: every variant at every staleness), e.g. 'rkl-stale|k=8'")
    ap.add_argument("--plan", action="store_true",
                    help="the claims plan's fresh run: part 2 at --seeds, under the bench async_opd_cache_plan")
    a = ap.parse_args()
    if a.plan:
        run(a.seeds, ("cache",), PLAN)
    elif not a.report_only:
        run(a.seeds, ("train", "cache") if a.only is None else (a.only,), arms=a.arms)
    report()
