"""ESPO against PPO on the long-response task: rollout tokens saved, accuracy, and where the stops land.

    python benchmarks/espo_table.py                  # 3 seeds x 2 arms (about 2 minutes each on one core) + probe
    python benchmarks/espo_table.py --report-only    # rebuilds the table from the CSV

The claim ("ESPO: Early-Stopping Proximal Policy Optimization", arXiv:2605.29860): stopping a rollout once a
regret computed from the sampler's logits says it has failed saves more than 20% of the rollout tokens
cumulatively, at an accuracy above PPO's.

Training (algos/espo.py, one file, so everything but the stop is the same code): tiny-sums on `sums` (5 one-digit
operands with running totals, about 33 tokens per response), STEPS rollout batches of PROMPTS prompts x 1, lr 1e-4,
two PPO epochs, one thread. Arms:
  PPO            --stop-k inf   nothing stops: algos/ppo.py exactly (tests/test_espo.py checks it step by step)
  ESPO k=3       --stop-k 3     the default stop rule (smoothing 0.5, threshold mean + 3 std, r_fail = 0)
Per run: held-out greedy accuracy, generated tokens, decode seconds; per seed the tokens saved,
1 - tokens(ESPO) / tokens(PPO), and where the stops land relative to the first token that leaves the reference
solution (first_dev, see algos/espo.py).

Probe (seconds, no training, 3 seeds of prompts): the starting policy's full responses (no stop) with the rule
applied after the fact at several k (statistics from one batch, applied to another): stops, tokens that would be
saved, stops after the first deviation, and false stops (stopped responses that would have earned the reward).
Random-stop control (the rule at k = 3 against chance): the same stop positions, as many as the rule makes, given
to randomly drawn rows that are still generating there (RANDOM_DRAWS draws, averaged). Any stop lands after the
first deviation more often the later it comes, and any stop shortens the share of tokens generated after it; the
rule marks the failure only where it beats this control.

Writes benchmarks/results/espo.csv (rows through benchmarks/_results.py) and espo.md.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows, mean_std  # noqa: E402

CSV, NAME, SCRIPT = "espo.csv", "espo", "algos/espo.py"
STEPS, PROMPTS = 30, 64
ARMS = {"PPO": math.inf, "ESPO k=3": 3.0}
FLAGS = dict(steps=STEPS, prompts_per_step=PROMPTS, eval_every=STEPS, eval_examples=300, pass_k=0, eval_hard=False,
             threads=1)
PROBE_K = (2.0, 3.0, 4.0)
RANDOM_DRAWS = 50


def run(seeds) -> None:
    from algos import espo

    for seed in seeds:
        tokens = {}
        for label, k in ARMS.items():
            s = espo.main(espo.Args(stop_k=k, seed=seed, out_dir=f"runs/bench_espo/s{seed}",
                                    exp_name=label.split()[0].lower(), **FLAGS))
            s["gen_s"] = s["gen_tokens"] / s["tokens_per_s"]
            tokens[label] = s["gen_tokens"]
            cmd = (f"python algos/espo.py --stop-k {k} --steps {STEPS} --prompts-per-step {PROMPTS} --eval-every {STEPS} "
                   f"--eval-examples 300 --pass-k 0 --no-eval-hard --threads 1 --seed {seed}")
            append_rows(CSV, NAME, SCRIPT, label, seed, s, cmd)
        append_rows(CSV, NAME, SCRIPT, "ESPO k=3", seed, {"token_savings": 1 - tokens["ESPO k=3"] / tokens["PPO"]},
                    "python benchmarks/espo_table.py")


def kept_after_dev(stop, dev, lengths):
    """Where stops land: (stops whose kept prefix holds the first deviation / stops, tokens kept after the first
    deviation / tokens kept); stop [B] (-1: not stopped, else the last kept position), dev [B] (-1: none)."""
    import torch

    stopped = stop >= 0
    kept = torch.where(stopped, stop + 1, lengths)
    after = stopped & (dev >= 0) & (dev <= stop)
    post = ((kept - dev).clamp(min=0) * (dev >= 0)).sum().item() / max(1, kept.sum().item())
    return after.sum().item() / max(1, stopped.sum().item()), post


def random_stops(stop, eligible, gen):
    """The rule's stop positions, each given to a random row that is still generating there (one stop per row)."""
    import torch

    out = torch.full_like(stop, -1)
    for t in stop[stop >= 0].tolist():
        free = ((out < 0) & eligible[:, t]).nonzero().flatten()
        if len(free):
            out[free[torch.randint(len(free), (1,), generator=gen)]] = t
    return out


def probe(seeds, n: int = 512) -> None:
    """The stop rule applied after the fact to the starting policy's full responses, and the random-stop control."""
    from dataclasses import replace

    import numpy as np
    import torch

    import common
    from algos import _llm as llm
    from algos import espo

    torch.set_num_threads(1)
    args = espo.Args()
    model, tok = common.load_model(args.model)
    task = llm.make_task(args.task, args.digits)
    for seed in seeds:
        probe_seed(seed, n, args, common.Sampler(model), tok, task)


def probe_seed(seed, n, args, sampler, tok, task) -> None:
    from dataclasses import replace

    import numpy as np
    import torch

    from algos import espo

    torch.manual_seed(seed)
    batches = []
    for i in range(2):  # one batch measures the statistics, the other is stopped with them
        rng = np.random.default_rng([99, i] if seed == 0 else [99, i, seed])
        batches.append(espo.rollout(sampler, tok, task, replace(args, prompts_per_step=n), rng, "cpu"))
    stats = espo.RegretStats(args.regret_momentum)
    stats.update(batches[0]["z"], batches[0]["completion_mask"])
    b = batches[1]
    mask = b["completion_mask"]
    eligible = mask.bool() & (b["completion_ids"] != tok.eos_token_id)
    lengths, dev, correct = mask.sum(1), b["first_dev"], b["rewards"] == 1
    for k in PROBE_K:
        thr = stats.threshold(k, 1)
        stop = espo.stop_index(b["z"], eligible, thr)
        stopped = stop >= 0
        after = stopped & (dev >= 0) & (dev <= stop)
        m = {"threshold": thr, "stop_frac": stopped.float().mean().item(),
             "saved_frac": ((lengths - stop - 1) * stopped).sum().item() / lengths.sum().item(),
             "stop_after_dev_frac": after.sum().item() / max(1, stopped.sum().item()),
             "stop_lag": (stop - dev)[after].float().mean().item() if after.any() else float("nan"),
             "false_stop_frac": (stopped & correct).sum().item() / max(1, stopped.sum().item()),
             "failures_stopped_frac": (stopped & ~correct).sum().item() / max(1, (~correct).sum().item()),
             "reward": correct.float().mean().item(), "post_dev_token_frac":
             ((lengths - dev) * (dev >= 0)).sum().item() / lengths.sum().item()}
        m["kept_post_dev_frac"] = kept_after_dev(stop, dev, lengths)[1]
        append_rows(CSV, "espo_probe", SCRIPT, f"probe k={k:g}", seed, m, "python benchmarks/espo_table.py")
        if k == 3.0:  # the random-stop control: the same stop positions on random rows
            gen = torch.Generator().manual_seed(seed)
            draws = [kept_after_dev(random_stops(stop, eligible, gen), dev, lengths) for _ in range(RANDOM_DRAWS)]
            append_rows(CSV, "espo_probe", SCRIPT, "probe k=3, random rows", seed,
                        {"stop_after_dev_frac": float(np.mean([d[0] for d in draws])),
                         "kept_post_dev_frac": float(np.mean([d[1] for d in draws])), "stop_frac": m["stop_frac"]},
                        "python benchmarks/espo_table.py")


def report() -> None:
    by, probe_rows, meta = defaultdict(dict), defaultdict(dict), None
    for r in read_rows(CSV):  # a later row of the same (config, seed, metric) wins
        target = probe_rows if r["bench"] == "espo_probe" else by
        target[r["config"]].setdefault(r["seed"], {})[r["metric"]] = float(r["value"])
        meta = meta or (r if r["bench"] == NAME else None)
    if not by:
        raise SystemExit(f"no rows in benchmarks/results/{CSV}; run without --report-only first")
    get = lambda label, k: [r[k] for r in by.get(label, {}).values() if k in r]  # noqa: E731
    f = mean_std
    lines = ["| arm | held-out acc start | end | generated tokens | tokens saved vs PPO | decode s | rows stopped | "
             "stops after the first deviation | stop lag (tokens) | tokens after the first deviation | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        n = len([r for r in runs.values() if "eval_acc_end" in r])
        lines.append(f"| {label} | {f(get(label, 'eval_acc_start'), 100)} | {f(get(label, 'eval_acc_end'), 100)} | "
                     f"{f(get(label, 'gen_tokens'), 1, 0)} | {f(get(label, 'token_savings'), 100) if label != 'PPO' else '-'}"
                     f" | {f(get(label, 'gen_s'), 1, 1)} | {f(get(label, 'stop_frac'), 100)} | "
                     f"{f(get(label, 'stop_after_dev_frac'), 100) if label != 'PPO' else '-'} | "
                     f"{f(get(label, 'stop_lag'), 1, 1) if label != 'PPO' else '-'} | "
                     f"{f(get(label, 'post_dev_token_frac'), 100)} | {n} |")
    lines += ["", f"Mean ± std over seeds; percentages except tokens and seconds. tiny-sums on `sums` (5 one-digit "
              f"operands, running totals), {STEPS} rollout batches of {PROMPTS} prompts x 1, lr 1e-4, 2 PPO epochs, "
              f"one thread; 300 held-out prompts, greedy. PPO = `algos/espo.py --stop-k inf`, which is algos/ppo.py "
              f"exactly (tested). Tokens saved: 1 - generated tokens of ESPO / of PPO, per seed. 'First deviation': "
              f"the first token that leaves the reference solution (a wrong running total or a miscopied operand); "
              f"'stops after': the kept prefix already holds it; lag: tokens from it to the stop. Decode seconds: "
              f"batched Hugging Face decoding runs until a batch's last row ends, so fewer tokens barely shorten it."]
    if probe_rows:
        lines += ["", "| starting policy, rule after the fact | threshold | rows stopped | tokens saved | stops after the "
                  "first deviation | stop lag | false stops (would have been right) | failures stopped | kept tokens "
                  "after the first deviation | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
        pg = lambda label, k, scale=100, d=1: (f(v, scale, d) if (v := [r[k] for r in probe_rows[label].values()  # noqa: E731
                                                                      if k in r]) else "-")
        for label in probe_rows:
            lines.append(f"| {label} | {pg(label, 'threshold', 1, 2)} | {pg(label, 'stop_frac')} | "
                         f"{pg(label, 'saved_frac')} | {pg(label, 'stop_after_dev_frac')} | {pg(label, 'stop_lag', 1)} | "
                         f"{pg(label, 'false_stop_frac')} | {pg(label, 'failures_stopped_frac')} | "
                         f"{pg(label, 'kept_post_dev_frac')} | {len(probe_rows[label])} |")
        first = next(iter(probe_rows))
        lines += ["", f"Per seed 512 full responses of tiny-sums (reward {pg(first, 'reward')}%, "
                  f"{pg(first, 'post_dev_token_frac')}% of their tokens after the first deviation), the threshold "
                  f"from another 512; smoothing 0.5. A false stop is a stopped response whose full text earned the "
                  f"reward (the tiny model sometimes reaches the right sum after a wrong step). 'random rows': the "
                  f"k = 3 rule's stop positions given to randomly drawn rows still generating there, {RANDOM_DRAWS} "
                  f"draws averaged: the control for where a stop of that timing lands by chance."]
    if meta:
        lines += ["", f"Hardware: {meta['hardware']} (shared); {meta['versions']}; commit {meta['commit']}. Rows: "
                  f"`benchmarks/results/{CSV}`; command: `python benchmarks/espo_table.py`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--no-probe", action="store_true", help="skip the starting-policy probe")
    ap.add_argument("--probe-only", action="store_true", help="only the starting-policy probe (no training)")
    a = ap.parse_args()
    if not a.report_only:
        if not a.no_probe:
            probe(a.seeds)
        if not a.probe_only:
            run(a.seeds)
    report()
