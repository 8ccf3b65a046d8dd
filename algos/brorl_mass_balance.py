"""BroRL's mass balance: one policy-gradient step on a softmax policy, and how the number of rollouts N decides
whether every correct token gains probability mass. No language model; seconds on a CPU.

Paper: "BroRL: Scaling Reinforcement Learning via Broadened Exploration", arXiv:2510.01180. Its
one-step analysis: tokens sampled in the rollouts always expand the correct mass; unsampled tokens can add or
remove mass depending on their distribution and the net reward; as N grows the unsampled part fades, and in
simulation a large enough N makes every correct token gain. BroRL's practical advice (hundreds of rollouts per
prompt) rests on this; this script measures the one-step claim.

Parent: none.

Setting (one prompt, one decision): pi = softmax(z) over V tokens, a correct subset C (reward 1; the others
reward --r-wrong, default 0). One REINFORCE step from N samples y_1..y_N ~ pi, with c_v = #{i: y_i = v}:
  advantage      A_i = r(y_i) - b,  b = mean_i r(y_i) (--baseline mean) or b = 0 (--baseline none)
  logit step     dz = lr/N sum_i A_i (e_{y_i} - pi) = lr/N (c * (r - b) - S pi),  S = sum_i A_i   pg_logit_step
  mass change    exact: dpi = softmax(z + dz) - softmax(z)                                       mass_change
                 first order: dpi_v = pi_v (dz_v - pi . dz)  (softmax Jacobian diag(pi) - pi pi^T)
                                                                                    first_order_mass_change
  correct mass   Q = sum_{v in C} pi_v;  first order dQ = sum_v pi_v (1[v in C] - Q) dz_v
  mass balance   dQ = sampled part (v with c_v > 0) + unsampled part (c_v = 0), the unsampled part being
                 -lr S/N sum_{c_v = 0} pi_v^2 (1[v in C] - Q): zero with the mean baseline (S = 0), where every
                 sampled term is >= 0 (the sign of r_v - b is that of 1[v in C] - Q)               mass_balance
  expectation    E[dQ] (first order) = lr k_N sum_v pi_v^2 (1[v in C] - Q)(r_v - pi . r), k_N = (N-1)/N with the
                 mean baseline (it includes the sample itself), 1 without            expected_first_order_gain
Per token, an unsampled correct token j moves by -pi_j (pi . dz): it gains only when the sampled step lowers
the pi-weighted logit average. Even the expected (N -> infinity) step, in direction pi * (r - R), R = pi . r,
raises a correct token j only when pi_j (1 - R) > sum_v pi_v^2 (r_v - R): a dominant correct token can squeeze
the rarest ones (all_gain_in_expectation). The simulation reports P(every correct token gains) overall and split
by that condition.

Monte Carlo (simulate): T random policies (logits ~ N(0, logit_std^2), a random correct subset), each hit by
one step for every N in --ns; the policies and their seeds are shared across N (common random numbers).

Deviations from the paper:
- The paper's analysis is of an LLM's per-token update inside full RL training; this is its one-step,
  one-position reading with a plain softmax over logits (the model of its analysis), REINFORCE with a
  group-mean baseline by default (--baseline none gives raw rewards, where the net reward S moves unsampled
  tokens).
- Policies are random (Gaussian logits), not a trained model's; the split by all_gain_in_expectation says
  which policies the claim can hold for at all.
- "Gains mass" uses the exact softmax change of one step of size lr (first-order values are reported beside).

Commands:
  python algos/brorl_mass_balance.py                                  # seconds on a CPU: CSV, table, plot
  python algos/brorl_mass_balance.py --baseline none --r-wrong -1     # raw +-1 rewards: the net reward matters
  python algos/brorl_mass_balance.py --out-dir benchmarks/results --exp-name brorl   # the committed results
Writes out_dir/exp_name.csv (one row per (N, metric), with the commit, hardware and versions), .md and .png, and
returns a summary. Expected result: P(every correct token gains mass) rises with N (0 at N = 1, where a
mean baseline gives no step); among policies whose expected step raises every correct token it approaches
1 by N = 1024; among the others it falls toward 0. See benchmarks/results/brorl.md.
"""
from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "brorl"
    """name of the run: out_dir/exp_name.csv, .md and .png"""
    seed: int = 0
    """random seed of the policies and the samples"""
    out_dir: str = "runs"
    """where the CSV, the table and the plot go"""
    # the policy
    vocab: int = 32
    """V: tokens of the softmax policy"""
    n_correct: int = 4
    """|C|: correct tokens (a random subset per policy)"""
    logit_std: float = 2.0
    """logits ~ N(0, logit_std^2): larger = more peaked, more mass in the tail of rare tokens"""
    # the step
    baseline: Literal["mean", "none"] = "mean"
    """mean: A_i = r_i - mean_i r (a group baseline, as GRPO/RLOO); none: A_i = r_i"""
    r_wrong: float = 0.0
    """reward of a wrong token (a correct one gets 1)"""
    lr: float = 0.1
    """step size on the logits"""
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    """rollouts per prompt N to simulate"""
    trials: int = 4000
    """random policies (each gets one step per N)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag."""
    if args.vocab < 2:
        raise SystemExit(f"--vocab must be at least 2, got {args.vocab}")
    if not 1 <= args.n_correct < args.vocab:
        raise SystemExit(f"--n-correct must be in 1..vocab-1 = {args.vocab - 1}, got {args.n_correct}")
    if not args.ns or any(n < 1 for n in args.ns):
        raise SystemExit(f"--ns must be positive rollout counts, got {args.ns}")
    if args.trials < 1 or args.lr <= 0 or args.logit_std < 0:
        raise SystemExit("--trials and --lr must be positive and --logit-std non-negative")
    if args.r_wrong >= 1:
        raise SystemExit(f"--r-wrong must be below the correct reward 1, got {args.r_wrong}")


# ---- the idea: one policy-gradient step and the mass it moves ----
def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rewards_of(correct: np.ndarray, r_wrong: float) -> np.ndarray:
    """r_v: 1 on correct tokens, r_wrong elsewhere; correct [T, V] bool -> [T, V]."""
    return np.where(correct, 1.0, r_wrong)


def pg_logit_step(pi, counts, correct, lr: float, baseline: str, r_wrong: float):
    """dz = lr/N sum_i A_i (e_{y_i} - pi) from the sample counts; pi, counts, correct [T, V] -> dz [T, V]."""
    n = counts.sum(-1, keepdims=True)
    r = rewards_of(correct, r_wrong)
    b = (counts * r).sum(-1, keepdims=True) / n if baseline == "mean" else 0.0
    s = (counts * (r - b)).sum(-1, keepdims=True)  # S = sum_i A_i (0 with the mean baseline)
    return lr / n * (counts * (r - b) - s * pi)


def mass_change(z, dz):
    """Exact change of every token's probability after the step: softmax(z + dz) - softmax(z)."""
    return softmax(z + dz) - softmax(z)


def first_order_mass_change(pi, dz):
    """dpi_v = pi_v (dz_v - pi . dz): the softmax Jacobian applied to the step."""
    return pi * (dz - (pi * dz).sum(-1, keepdims=True))


def mass_balance(pi, dz, counts, correct):
    """First-order dQ split into the sampled tokens' part and the unsampled tokens' part; each [T]."""
    q = (pi * correct).sum(-1, keepdims=True)
    term = pi * (correct - q) * dz  # dQ/dz_v * dz_v
    sampled = counts > 0
    return (term * sampled).sum(-1), (term * ~sampled).sum(-1)


def expected_first_order_gain(pi, correct, n: int, lr: float, baseline: str, r_wrong: float):
    """E[dQ] to first order: lr k_N sum_v pi_v^2 (1[v in C] - Q)(r_v - pi . r); [T]."""
    r = rewards_of(correct, r_wrong)
    q = (pi * correct).sum(-1, keepdims=True)
    k = (n - 1) / n if baseline == "mean" else 1.0
    return lr * k * (pi ** 2 * (correct - q) * (r - (pi * r).sum(-1, keepdims=True))).sum(-1)


def all_gain_in_expectation(pi, correct, r_wrong: float):
    """Whether the expected step (direction pi * (r - pi . r), any N) raises every correct token, to first order."""
    r = rewards_of(correct, r_wrong)
    d = first_order_mass_change(pi, pi * (r - (pi * r).sum(-1, keepdims=True)))
    return np.where(correct, d > 0, True).all(-1)


def sample_policies(rng, trials: int, vocab: int, n_correct: int, logit_std: float):
    """T random policies: logits z [T, V] and a random correct subset [T, V] bool."""
    z = rng.normal(0.0, logit_std, size=(trials, vocab))
    correct = np.zeros((trials, vocab), dtype=bool)
    idx = np.argsort(rng.random((trials, vocab)), axis=1)[:, :n_correct]
    np.put_along_axis(correct, idx, True, axis=1)
    return z, correct


def simulate(args: Args) -> list[dict]:
    """One row of Monte Carlo figures per N (see the header)."""
    rng = np.random.default_rng(args.seed)
    z, correct = sample_policies(rng, args.trials, args.vocab, args.n_correct, args.logit_std)
    pi = softmax(z)
    cond = all_gain_in_expectation(pi, correct, args.r_wrong)
    rows = []
    for n in args.ns:
        counts = np.random.default_rng([args.seed, n]).multinomial(n, pi).astype(float)  # [T, V]
        dz = pg_logit_step(pi, counts, correct, args.lr, args.baseline, args.r_wrong)
        d = mass_change(z, dz)
        gain = np.where(correct, d > 0, True).all(-1)
        dq = (d * correct).sum(-1)
        dq1 = (first_order_mass_change(pi, dz) * correct).sum(-1)
        part_s, part_u = mass_balance(pi, dz, counts, correct)
        rows.append({"n": n, "p_all_gain": gain.mean(), "p_all_gain_se": gain.std() / np.sqrt(len(gain)),
                     "p_all_gain_if_expected": gain[cond].mean() if cond.any() else float("nan"),
                     "p_all_gain_if_not_expected": gain[~cond].mean() if (~cond).any() else float("nan"),
                     "dq_mean": dq.mean(), "dq_se": dq.std() / np.sqrt(len(dq)), "dq_first_order_mean": dq1.mean(),
                     "dq_first_order_expected": expected_first_order_gain(pi, correct, n, args.lr, args.baseline,
                                                                          args.r_wrong).mean(),
                     "sampled_part_mean": part_s.mean(), "sampled_part_min": part_s.min(),
                     "unsampled_part_mean": part_u.mean(), "p_dq_negative": (dq < 0).mean(),
                     "correct_unsampled_frac": ((counts == 0) & correct).sum() / correct.sum(),
                     "frac_all_gain_in_expectation": cond.mean()})
    return [{k: float(v) if k != "n" else int(v) for k, v in r.items()} for r in rows]


# ---- output ----
def provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"commit": os.environ.get("PROVENANCE_COMMIT") or commit,
            "hardware": f"{platform.machine()} cpu x{os.cpu_count()}",
            "versions": f"python {platform.python_version()}; numpy {np.__version__}",
            "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def command_of(args: Args) -> str:
    """The command line that reproduces this run (the flags that differ from the defaults)."""
    flags = []
    for k, v in asdict(args).items():
        if v != getattr(Args, k):
            flags.append(f"--{k.replace('_', '-')} " + (" ".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    return " ".join(["python algos/brorl_mass_balance.py"] + flags)


def config_name(args: Args) -> str:
    return (f"V{args.vocab} C{args.n_correct} std{args.logit_std:g} lr{args.lr:g} baseline-{args.baseline} "
            f"r_wrong{args.r_wrong:g}")


def write_csv(rows: list[dict], args: Args, path: Path, command: str) -> None:
    """Long format, one row per (N, metric): bench, script, config, seed, metric, value + provenance."""
    prov = provenance()
    fields = ["bench", "script", "config", "seed", "metric", "value", "command", "commit", "hardware", "versions",
              "timestamp"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            for k, v in r.items():
                if k != "n":
                    w.writerow({"bench": "brorl", "script": "algos/brorl_mass_balance.py", "config": config_name(args),
                                "seed": args.seed, "metric": f"{k}_n{r['n']}", "value": v, "command": command, **prov})


def write_table(rows: list[dict], args: Args, path: Path, command: str, wall_s: float) -> None:
    pct = lambda v: "-" if np.isnan(v) else f"{100 * v:.1f}"  # noqa: E731
    lines = ["| N | P(every correct token gains), % | if the expected step raises all | if not | E[dQ] x1e3 "
             "(MC ± se) | first order, MC | first order, analytic | sampled part | unsampled part | correct tokens "
             "never sampled, % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {pct(r['p_all_gain'])} | {pct(r['p_all_gain_if_expected'])} | "
                     f"{pct(r['p_all_gain_if_not_expected'])} | {1e3 * r['dq_mean']:.3f} ± {1e3 * r['dq_se']:.3f} | "
                     f"{1e3 * r['dq_first_order_mean']:.3f} | {1e3 * r['dq_first_order_expected']:.3f} | "
                     f"{1e3 * r['sampled_part_mean']:.3f} | {1e3 * r['unsampled_part_mean']:.3f} | "
                     f"{pct(r['correct_unsampled_frac'])} |")
    lines += ["", f"{args.trials} random softmax policies over V = {args.vocab} tokens (logits ~ N(0, "
              f"{args.logit_std:g}^2), {args.n_correct} correct tokens at random), one REINFORCE step of size "
              f"{args.lr:g} on the logits with baseline '{args.baseline}' (wrong reward {args.r_wrong:g}), the same "
              f"policies for every N. The expected step raises every correct token for "
              f"{pct(rows[0]['frac_all_gain_in_expectation'])}% of the policies. dQ: change of the total correct "
              f"mass; its first-order value splits into the sampled and unsampled tokens' parts. Seed {args.seed}; "
              f"{wall_s:.1f} s. Command: `{command}`."]
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], args: Args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, style in (("p_all_gain", "all policies", "o-"), ("p_all_gain_if_expected",
                              "expected step raises every correct token", "s--"),
                              ("p_all_gain_if_not_expected", "expected step does not", "^:")):
        a.plot(n, [r[key] for r in rows], style, label=label)
    a.set(xscale="log", xlabel="rollouts per prompt N", ylabel="P(every correct token gains mass)", ylim=(-0.02, 1.02),
          title="one policy-gradient step")
    a.legend(fontsize=8)
    dq, se = np.array([r["dq_mean"] for r in rows]), np.array([r["dq_se"] for r in rows])
    b.errorbar(n, 1e3 * dq, 1e3 * se, fmt="o-", label="E[dQ], exact step (MC)")
    b.plot(n, [1e3 * r["dq_first_order_expected"] for r in rows], "k--", label="first order, analytic")
    b.plot(n, [1e3 * r["sampled_part_mean"] for r in rows], ":", label="sampled tokens' part")
    b.plot(n, [1e3 * r["unsampled_part_mean"] for r in rows], ":", label="unsampled tokens' part")
    b.set(xscale="log", xlabel="rollouts per prompt N", ylabel="change of correct mass (x1e-3)",
          title=f"V={args.vocab}, |C|={args.n_correct}, baseline {args.baseline}")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    t0 = time.time()
    rows = simulate(args)
    wall_s = time.time() - t0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = command_of(args)
    write_csv(rows, args, out / f"{args.exp_name}.csv", command)
    write_table(rows, args, out / f"{args.exp_name}.md", command, wall_s)
    plot(rows, args, out / f"{args.exp_name}.png")
    first, last = rows[0], rows[-1]
    summary = {"n_min": first["n"], "n_max": last["n"], "p_all_gain_first": first["p_all_gain"],
               "p_all_gain_last": last["p_all_gain"], "p_all_gain_if_expected_last": last["p_all_gain_if_expected"],
               "p_all_gain_if_not_expected_last": last["p_all_gain_if_not_expected"],
               "frac_all_gain_in_expectation": first["frac_all_gain_in_expectation"],
               "dq_mean_last": last["dq_mean"], "sampled_part_min": min(r["sampled_part_min"] for r in rows),
               "wall_s": wall_s}
    print(f"P(every correct token gains mass): {100 * summary['p_all_gain_first']:.1f}% at N={first['n']} -> "
          f"{100 * summary['p_all_gain_last']:.1f}% at N={last['n']} "
          f"({100 * summary['p_all_gain_if_expected_last']:.1f}% where the expected step raises all); "
          f"written to {out / args.exp_name}.csv/.md/.png")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
