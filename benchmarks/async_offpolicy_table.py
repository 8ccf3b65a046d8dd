"""Asynchronous off-policy GRPO: held-out accuracy against rollout staleness k per correction, the KL between the
sampler and the trainer, and the fraction of tokens each correction clips or masks.

    python benchmarks/async_offpolicy_table.py                  # the sweep (about 12 minutes per 2 seeds on a shared core)
    python benchmarks/async_offpolicy_table.py --seeds 2        # add a seed
    python benchmarks/async_offpolicy_table.py --seeds 0 --corrections plain m2po-clip --staleness 16   # a subset
    python benchmarks/async_offpolicy_table.py --report-only    # rebuild the table from the committed CSV

algos/async_offpolicy_grpo.py on `add` from tiny-0.6m, for the corrections plain PPO-clip around the behaviour
policy, AReaL's decoupled PPO and M2PO's water-filling clip form, at staleness k in {0, 4, 16, 64} (a FIFO of
generated batches: update t trains the batch the weights of update t - k sampled; the first batches come from
the initial weights, so a run of STEPS updates has a mean trained age below k, reported per row). At k = 0
decoupled PPO is plain PPO (mu = pi_prox up to float error), so it is not run again. The claims: M2PO clips far
fewer tokens than PPO-clip under high staleness (abstract: 1.22% -> 0.06%) and stays near on-policy accuracy;
decoupled PPO keeps learning from stale data where PPO-clip around the behaviour policy degrades. M2PO's clip form
never narrows its range below [0.7, 1.5], which contains PPO's [0.8, 1.2], so it clips fewer tokens by
construction (tests/test_async_offpolicy_grpo.py); the paper's quantity is the share of tokens the second-moment
mask drops (--correction m2po-mask), measured beside PPO-clip's clipped share.
Rows: benchmarks/results/async_offpolicy.csv; table: benchmarks/results/async_offpolicy.md.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows, mean_std  # noqa: E402

CSV, NAME, SCRIPT = "async_offpolicy.csv", "async_offpolicy", "algos/async_offpolicy_grpo.py"
CORRECTIONS = ("plain", "decoupled", "m2po-clip", "m2po-mask")
STALENESS = (0, 4, 16, 64)
FLAGS = dict(steps=40, prompts_per_step=16, group_size=8, lr=1e-4, eval_every=40, eval_examples=300, pass_k=0,
             eval_hard=False, threads=1)


def configs(corrections=CORRECTIONS, staleness=STALENESS):
    return [(c, k) for k in staleness for c in corrections if not (c == "decoupled" and k == 0)]


def run(seeds, corrections=CORRECTIONS, staleness=STALENESS) -> None:
    from algos import async_offpolicy_grpo as ao

    for seed in seeds:
        for c, k in configs(corrections, staleness):
            s = ao.main(ao.Args(correction=c, staleness=k, seed=seed, out_dir=f"runs/bench_async_offpolicy/s{seed}",
                                exp_name=f"{c}_k{k}", **FLAGS))
            flags = " ".join(f"--{n.replace('_', '-')} {v}" if not isinstance(v, bool) else
                             (f"--{n.replace('_', '-')}" if v else f"--no-{n.replace('_', '-')}") for n, v in FLAGS.items())
            append_rows(CSV, NAME, SCRIPT, f"{c}|k={k}", seed, s,
                        f"python {SCRIPT} --correction {c} --staleness {k} {flags} --seed {seed}")


def collect():
    by = defaultdict(dict)  # config -> seed -> {metric: value} (a later row wins)
    meta = None
    for r in read_rows(CSV):
        by[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        meta = r
    return by, meta


def report() -> None:
    by, meta = collect()
    if not by:
        return
    get = lambda c, k, m: [v[m] for v in by.get(f"{c}|k={k}", {}).values() if m in v]  # noqa: E731
    cell = lambda c, k, m, scale=100.0, d=1: mean_std(get(c, k, m), scale, d)  # noqa: E731
    lines = ["| correction | " + " | ".join(f"k = {k}" for k in STALENESS) + " |", "|---|" + "---|" * len(STALENESS)]
    for c in CORRECTIONS:
        src = lambda k: "plain" if c == "decoupled" and k == 0 else c  # noqa: E731
        lines.append(f"| {c} | " + " | ".join(cell(src(k), k, "eval_acc_end") for k in STALENESS) + " |")
    start = mean_std([v for c, k in configs() for v in get(c, k, "eval_acc_start")], 100, 1, bare_single=True)
    lines.append("| mean trained age (versions) | " + " | ".join(cell("plain", k, "staleness_mean", 1.0) for k in STALENESS)
                 + " |")
    lines += ["", "| k | KL(mu ‖ pi) | plain: clipped % | decoupled: clipped + masked % | M2PO clip: clipped % | "
              "M2PO mask: masked % | ESS/B (plain) | gradient noise (plain) |", "|---|---|---|---|---|---|---|---|"]
    for k in STALENESS:
        dec = "(= plain)" if k == 0 else mean_std([a + b for a, b in zip(get("decoupled", k, "clipfrac"),
                                                                         get("decoupled", k, "maskfrac"))], 100, 2)
        lines.append(f"| {k} | {cell('plain', k, 'kl_mu_pi', 1.0, 3)} | {cell('plain', k, 'clipfrac', 100.0, 2)} | "
                     f"{dec} | {cell('m2po-clip', k, 'clipfrac', 100.0, 2)} | {cell('m2po-mask', k, 'maskfrac', 100.0, 2)} | "
                     f"{cell('plain', k, 'ess_ratio', 1.0, 2)} | "
                     f"{cell('plain', k, 'grad_noise', 1.0, 2)} |")
    n_seeds = max(len(v) for v in by.values())
    lines += ["", f"Held-out greedy accuracy (%) after {FLAGS['steps']} updates (start {start}), mean ± std over "
              f"{n_seeds} seeds; `add` (2-digit addition) from tiny-0.6m, {FLAGS['prompts_per_step']} prompts x "
              f"{FLAGS['group_size']} rollouts per batch, two PPO epochs, lr {FLAGS['lr']:g} (grpo.py's; chosen so that "
              f"k = 16 shows a clear KL(mu ‖ pi), the second table), {FLAGS['eval_examples']} held-out prompts. "
              f"k is the FIFO depth: the first batches come from the initial weights, so the mean trained age is below "
              f"k (the last row). KL(mu ‖ pi): the k3 estimate on the sampled tokens before each update, run mean; "
              f"clipped / masked %: tokens whose gradient the correction cuts, run mean; ESS/B of the untruncated "
              f"sequence weights pi_prox / mu; gradient noise |g_a - g_b|^2 / |g_a + g_b|^2 of two half-batches. "
              f"Decoupled PPO at k = 0 is plain PPO (not re-run); - = not run. Hardware: {meta['hardware']} (shared); "
              f"{meta['versions']}; commit {meta['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/async_offpolicy_table.py`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=CORRECTIONS)
    ap.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS), choices=STALENESS)
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.corrections, a.staleness)
    report()
