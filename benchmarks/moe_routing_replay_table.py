"""Routing replay on a mixture-of-experts policy: no replay, R3, PR2 and TIS under three kinds of mismatch, 3 seeds.

    python benchmarks/moe_routing_replay_table.py                # 3 seeds x 9 arms (about 60-100 s each, 1 thread)
    python benchmarks/moe_routing_replay_table.py --arms pr2 "pr2 (no noise)" --seeds 0 1 2   # some arms only
    python benchmarks/moe_routing_replay_table.py --report-only  # rebuilds the table and the plot from the CSV

The claims: R3 ("Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv:2510.11370) replays the rollout engine's routes in the training forward, which reduces the training-inference
KL and trains better than TIS; PR2 ("PR2: Predictive Routing Replay for MoE-Based LLM Reinforcement Learning",
arXiv:2606.00395) routes rollouts by a forecast of the router after the coming updates, so the replayed routes are
less stale and the routing-induced mismatch is smaller. Arms (algos/moe_routing_replay.py, one file, so everything
but the routing of the trainer and the rollout is the same code), on its default setting: tiny-moe (Qwen3-MoE, 4
experts, top-2), 2-digit addition, 32 prompts x 8 completions, 100 rollout batches of 4 optimiser steps, the rollout
engine a bf16 copy whose routers add N(0, 0.5^2) noise:
  none   --replay none                     the trainer routes by its own router
  r3     --replay r3                       the trainer replays the rollout's routes
  pr2    --replay pr2                      rollouts route by the forecast router, the trainer replays them
  tis    --replay none --sampler-is-cap 2  own routes, each token weighted by min(pi_old / mu, 2)
Where the mismatch comes from decides what a replay can remove, so R3 is measured against no replay under each:
  (default)       --router-noise-on select: the noise picks the engine's experts only, their gates come from the
                  noise-free logits; replaying the choice removes the injected mismatch by construction (a test pins
                  it: tests/test_moe_routing_replay.py), so this pair's KL is no verdict
  (logit noise)   --router-noise-on logits: the engine's router logits are noisy, experts and gate weights both
  (no noise)      --router-noise 0: bf16 numerics only (also PR2's setting: replayed routes go stale through router
                  drift alone)
Plan, fixed before the runs (the verdict rule of benchmarks/report.py; each claim's line in benchmarks/claims_plan.csv,
3 seeds per arm unless said): KL(mu || pi_old), r3 < none, by default (4 seeds), under logit noise (4 seeds) and under
bf16 only (8 seeds); the last two are decided by fresh runs only, their earlier 3 seeds per arm the pilot:
  --arms "r3 (logit noise)" "none (logit noise)" --seeds 0 1 2 3
  --arms "r3 (no noise)" "none (no noise)" --seeds 0 1 2 3 4 5 6 7
PR2's routes at the batch's last step, pr2 < r3 stale share (no noise; 4 seeds), and PR2's forecast, its top-k
route agreement with the router after the updates > R3's (no change) (no noise); held-out accuracy, r3 > tis, r3 > none
and pr2 > r3 (default noise).
Paired re-plan of the stale-share row (claims_plan.csv; seeds 0-3 are its pilot): both arms train the same policy from
the same initialisation on the same data of a seed, so pr2 < r3 is a paired t test on the per-seed differences of
  --arms "pr2 (no noise)" "r3 (no noise)" --seeds 20 21 22
Figures per run (means over the run's rollout batches): KL(mu || pi_old) by the k3 estimator, the variance of the
importance ratio pi_old / mu, the share of (token, layer) routes where the rollout's expert set differs from the
trainer router's own before the update (disagree) and at the batch's last optimiser step (stale), PR2's forecast
quality out of sample (explained: 1 - forecast MSE / MSE of forecasting no change; agree: share of routes whose top-k
under the forecast equals the top-k after the updates, against agree_r3 for the unchanged logits), held-out greedy
accuracy (500 prompts) before and after.

Writes benchmarks/results/moe_routing_replay.csv (rows through benchmarks/_results.py), moe_routing_replay.md and
moe_routing_replay.png (accuracy and KL over training, mean over seeds).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import (RESULTS, append_rows, fresh_run_tables, mean_std, read_rows,  # noqa: E402
                                 split_runs)

CSV, NAME, SCRIPT = "moe_routing_replay.csv", "moe_routing_replay", "algos/moe_routing_replay.py"
PLAN_RUNS = ((10, 19), (20, 22), (100, 147), (300, 318))  # the claims plan's fresh runs (benchmarks/claims_plan.csv)
ARMS = {"none": dict(replay="none"), "r3": dict(replay="r3"), "pr2": dict(replay="pr2"),
        "tis": dict(replay="none", sampler_is_cap=2.0),
        "none (logit noise)": dict(replay="none", router_noise_on="logits"),
        "r3 (logit noise)": dict(replay="r3", router_noise_on="logits"),
        "none (no noise)": dict(replay="none", router_noise=0.0),
        "r3 (no noise)": dict(replay="r3", router_noise=0.0), "pr2 (no noise)": dict(replay="pr2", router_noise=0.0)}
RUN_NAME = {" (no noise)": "_n0", " (logit noise)": "_logit"}
FLAGS = dict(eval_every=20, pass_k=0, eval_hard=False, threads=1)
QUARTERS = 4


def flags(kw: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items())


def run(seeds, arms) -> None:
    from algos import moe_routing_replay as mrr

    for seed in seeds:
        for label in arms:
            kw = ARMS[label]
            out = Path("runs/bench_moe") / f"s{seed}"
            name = label
            for suffix, short in RUN_NAME.items():
                name = name.replace(suffix, short)
            s = mrr.main(mrr.Args(seed=seed, out_dir=str(out), exp_name=name, **kw, **FLAGS))
            history = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
            train = [h for h in history if "mismatch/kl_k3" in h]
            q = max(1, len(train) // QUARTERS)
            for i in range(QUARTERS):  # the mismatch over training, by quarter
                part = train[i * q:(i + 1) * q]
                s[f"kl_k3_q{i + 1}"] = sum(h["mismatch/kl_k3"] for h in part) / len(part)
            for h in history:
                if "eval/acc" in h:
                    s[f"acc_step{h['step']}"] = h["eval/acc"]
            cmd = f"python {SCRIPT} {flags({**kw, 'eval_every': 20, 'pass_k': 0})} --no-eval-hard --seed {seed}"
            append_rows(CSV, NAME, SCRIPT, label, seed, s, cmd)


def report() -> None:
    by = defaultdict(dict)  # config -> seed -> metrics (a later row wins)
    for r in read_rows(CSV):
        by[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    parts = split_runs(by, PLAN_RUNS)
    by = parts[0][1]  # the first run; each fresh run of the claims plan gets a table of its own
    lines = ["| arm | held-out acc start | end | best | KL(mu \\|\\| pi_old) per token (1e-4) | ratio variance (1e-4) | "
             "routes differ (%) | stale at the last step (%) | PR2 forecast explained | PR2 routes right (%): "
             "forecast / no change | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_acc_best'), 100)} | {mean_std(get('kl_k3'), 1e4, 2)} | "
                     f"{mean_std(get('ratio_var'), 1e4, 2)} | {mean_std(get('disagree'), 100)} | "
                     f"{mean_std(get('stale'), 100)} | {mean_std(get('pr2_explained'), 1, 2)} | "
                     f"{mean_std(get('pr2_agree'), 100, 2)} / {mean_std(get('pr2_agree_r3'), 100, 2)} | {len(runs)} |")
    text = "\n".join(lines) + "\n\n" + (
        "`python benchmarks/moe_routing_replay_table.py`: tiny-moe on 2-digit addition, 100 rollout batches of "
        "32 x 8, 4 optimiser steps each; rollout engine in bf16 with router noise 0.5 on the choice of experts only "
        "(the default: replaying the choice removes that injected mismatch by construction), on the router logits "
        "(\"logit noise\": experts and gate weights both), or none (\"no noise\": bf16 numerics only); mean ± std over "
        "seeds. KL by the k3 estimator on the sampled tokens, pi_old scored by the trainer before the update. \"PR2 "
        "forecast explained\" is 1 - MSE(forecast) / MSE(no change) of the router-logit change over one rollout batch, "
        "out of sample (below 0: worse than R3's implicit forecast of no change); \"routes right\" is the share of "
        "(token, layer) routes whose top-k under the forecast (and under the unchanged logits) equals the top-k after "
        "the batch's updates.\n\n"
        "![accuracy and mismatch over training](benchmarks/results/moe_routing_replay.png)\n")
    cols = [("held-out acc end", "eval_acc_end", 100, 1), ("KL per token (1e-4)", "kl_k3", 1e4, 2),
            ("routes differ (%)", "disagree", 100, 1), ("stale at the last step (%)", "stale", 100, 1),
            ("PR2 forecast explained", "pr2_explained", 1, 2)]
    text += "\n".join(fresh_run_tables(parts[1:], cols, ARMS)) + "\n"
    (RESULTS / f"{NAME}.md").write_text(text)
    plot(by)
    print(text)


def plot(by) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label in ARMS:
        runs = list(by.get(label, {}).values())
        if not runs:
            continue
        steps = sorted({int(k[len("acc_step"):]) for r in runs for k in r if k.startswith("acc_step")})
        a1.plot(steps, [100 * sum(r[f"acc_step{s}"] for r in runs) / len(runs) for s in steps], marker="o",
                label=label)
        a2.semilogy(range(1, QUARTERS + 1), [sum(r[f"kl_k3_q{i}"] for r in runs) / len(runs)
                                             for i in range(1, QUARTERS + 1)], marker="o", label=label)
    a1.set(xlabel="rollout batch", ylabel="held-out greedy accuracy (%)", title="accuracy")
    a2.set(xlabel="quarter of training", ylabel="KL(mu || pi_old) per token", title="train-inference KL")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{NAME}.png", dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.arms)
    report()
