"""Step-GRPO against GRPO and a plain length penalty on sums with redundant check steps: held-out tokens per response,
semantic steps, held-out accuracy.

    python benchmarks/step_grpo_table.py                   # warm start once, then 3 arms x 3 seeds (one thread)
    python benchmarks/step_grpo_table.py --arms Step-GRPO --seeds 0   # some runs (the warm start is reused)
    python benchmarks/step_grpo_table.py --report-only     # rebuilds the table from the CSV
    python benchmarks/step_grpo_table.py --probe-only      # accuracy by number of checks of the starting policy

The claims ("Step-GRPO: Internalizing Dynamic Early Exit for Efficient Reasoning", arXiv:2604.16890): a step-aware
relative reward over semantic steps (cut at linguistic markers) penalises redundant checks against a group baseline;
on Qwen3-8B the model spends 32.0% fewer tokens than the vanilla model and avoids the accuracy drop of length-penalty
methods.

The setting: checksums4 (algos/step_grpo.py's CheckSumsTask: 4 one-digit operands written as running totals, each
followed in the references by a redundant 'check' restating it with probability 0.5). The shipped tiny-sums never
writes a check, so one warm start (WARM: next-token likelihood on those references, seed 0) makes a policy that
checks about every other step; every arm and seed starts from that same policy, saved to runs/bench_step_grpo/warm.
Arms, all algos/step_grpo.py from it (--warm-start-steps 0; COMMON below: 30 rollout batches of 16 prompts x G = 8,
lr 2e-4, 80 new tokens, 300 held-out prompts every 10 batches):
  GRPO       --step-reward 0: the verifier's 0/1 reward only
  GRPO+LP    --step-reward 0 --reward correct length:0.5: the plain length penalty, -0.5 x tokens / 80 for every
             response (a check costs a correct response about as much as under Step-GRPO: 0.5 x 12/80 = 0.08)
  Step-GRPO  --step-reward 0.5: R = r - 0.5 c min((S - b) / b, 1) over semantic steps S, b the group's correct mean
The arms differ in the reward only.

The plan, fixed before the runs (its lines are in benchmarks/claims_plan.csv):
- held-out tokens per greedy response at the end: Step-GRPO < GRPO, effect 32% (the abstract's 32.0% fewer tokens,
  there against the vanilla model; here against GRPO trained the same way, which isolates the reward).
- held-out accuracy at the end: Step-GRPO > GRPO+LP, effect 2.6 points (the abstract gives no figure for the length
  penalty's accuracy drop: the median of the gains this table's accuracy claims quote).
- held-out accuracy at the end: Step-GRPO ~ GRPO, margin 1.3 points (half of 2.6: "no accuracy drop").
- held-out tokens per response of GRPO+LP beside Step-GRPO's: described.
- 3 seeds per arm (what the budget allows: about 25 minutes of one CPU thread in all).

Writes benchmarks/results/step_grpo.csv (one row per run and metric; the eval curve as acc_s<step> and len_s<step>)
and step_grpo.md.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "step_grpo.csv", "step_grpo"
SEEDS = (0, 1, 2)
STEPS, EVAL_EVERY = 30, 10
OUT = "runs/bench_step_grpo"
WARM = dict(task="checksums4", digits=1, check_prob=0.5, warm_start_steps=250, warm_start_lr=1e-3, warm_start_batch=64,
            seed=0, threads=1)
COMMON = dict(task="checksums4", digits=1, max_new_tokens=80, steps=STEPS, prompts_per_step=16, group_size=8, lr=2e-4,
              eval_every=EVAL_EVERY, eval_examples=300, pass_k=0, eval_hard=False, warm_start_steps=0, threads=1)
FLAGS = (f"--model {OUT}/warm --task checksums4 --digits 1 --max-new-tokens 80 --steps {STEPS} --prompts-per-step 16 "
         f"--group-size 8 --lr 2e-4 --eval-every {EVAL_EVERY} --eval-examples 300 --pass-k 0 --no-eval-hard "
         f"--warm-start-steps 0 --threads 1")
ARMS = {"GRPO": ({"step_reward": 0.0}, " --step-reward 0"),
        "GRPO+LP": ({"step_reward": 0.0, "reward": ("correct", "length:0.5")},
                    " --step-reward 0 --reward correct length:0.5"),
        "Step-GRPO": ({"step_reward": 0.5}, " --step-reward 0.5")}


def warm_policy() -> str:
    """The shared starting policy: tiny-sums after WARM's warm start on checksums4's references (made once)."""
    import torch

    import common
    from algos import step_grpo as sg

    path = Path(OUT) / "warm"
    if not (path / "config.json").exists():
        torch.set_num_threads(WARM["threads"])
        common.set_seed(WARM["seed"])
        args = sg.Args(**WARM)
        model, tok = common.load_model(args.model)
        loss = sg.warm_start(model, tok, sg.make_check_task(args.task, args.digits, args.check_prob), args, "cpu")
        model.save_pretrained(path)
        tok.save_pretrained(path)
        print(f"warm start: last loss {loss:.3f}, saved to {path}")
    return str(path)


def probe_checks(model_path: str, prompts: int = 64, seed: int = 0) -> dict:
    """How right the starting policy's sampled responses are by their number of checks: G = 8 samples at temperature
    1 for `prompts` training prompts (what the first rollout batch sees), acc_checks<k> the share of responses with k
    checks that are right, n_checks<k> how many there are."""
    import numpy as np
    import torch

    import common
    from algos import step_grpo as sg

    torch.set_num_threads(WARM["threads"])
    torch.manual_seed(seed)
    model, tok = common.load_model(model_path)
    task = sg.make_check_task(COMMON["task"], COMMON["digits"], WARM["check_prob"])
    exs = task.sample("train", prompts, np.random.default_rng(seed))
    ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in exs]), 8, COMMON["max_new_tokens"])
    graded = [task.verify(t, exs[i // 8].answer) for i, t in enumerate(ro.texts)]
    out = {}
    for k in sorted({int(c["checks"]) for _, c in graded}):
        hits = [r for r, c in graded if int(c["checks"]) == k]
        out.update({f"n_checks{k}": len(hits), f"acc_checks{k}": float(np.mean(hits))})
    return out


def run_figures(run_dir: Path) -> dict:
    """The run's eval curves: accuracy (acc_s<step>) and tokens per response (len_s<step>)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {**{f"acc_s{r['step']}": r["eval/acc"] for r in rows if "eval/acc" in r},
            **{f"len_s{r['step']}": r["eval/length"] for r in rows if "eval/length" in r}}


def run(seeds, arms) -> None:
    from algos import step_grpo as sg

    model = warm_policy()
    if not by_config_seed(CSV)[0].get("warm-start probe"):
        append_rows(CSV, NAME, "algos/step_grpo.py", "warm-start probe", 0, probe_checks(model),
                    "python benchmarks/step_grpo_table.py --probe-only")
    for seed in seeds:
        for label in arms:
            extra, flag = ARMS[label]
            out, exp = f"{OUT}/s{seed}", label
            s = sg.main(sg.Args(model=model, seed=seed, out_dir=out, exp_name=exp, **COMMON, **extra))
            s.update(run_figures(Path(out) / exp))
            with open(Path(OUT) / "csv.lock", "w") as lock:  # one seed per process may run side by side
                fcntl.flock(lock, fcntl.LOCK_EX)
                append_rows(CSV, NAME, "algos/step_grpo.py", label, seed, s,
                            f"python benchmarks/step_grpo_table.py (warm start) && python algos/step_grpo.py {FLAGS} "
                            f"--seed {seed}{flag}")


def report() -> None:
    by, meta = by_config_seed(CSV)
    if not by:
        print(f"no rows in benchmarks/results/{CSV}")
        return
    lines = ["| arm | held-out acc start | end | tokens per response start | end | semantic steps start | end | "
             "train steps last batch | generated tokens | wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ARMS:
        runs = by.get(label, {})
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs.values() if k in r]  # noqa: E731
        lines.append(f"| {label} | {mean_std(get('eval_acc_start'), 100)} | {mean_std(get('eval_acc_end'), 100)} | "
                     f"{mean_std(get('eval_length_start'))} | {mean_std(get('eval_length_end'))} | "
                     f"{mean_std(get('eval_steps_start'), 1, 2)} | {mean_std(get('eval_steps_end'), 1, 2)} | "
                     f"{mean_std(get('train_steps_last'), 1, 2)} | {mean_std(get('gen_tokens'), 1, 0)} | "
                     f"{mean_std(get('wall_s'), 1, 0)} | {len(runs)} |")
    probe = by.get("warm-start probe", {}).get("0", {})
    if probe:
        ks = sorted(int(k[len("n_checks"):]) for k in probe if k.startswith("n_checks"))
        lines += ["", "The starting policy's sampled responses (temperature 1, 64 training prompts x 8) by their number "
                  "of checks: " + ", ".join(f"{k} checks: {100 * probe[f'acc_checks{k}']:.0f}% right "
                                            f"(n = {probe[f'n_checks{k}']:.0f})" for k in ks) + "."]
    row = meta[next(label for label in ARMS if label in meta)] if any(label in meta for label in ARMS) else \
        next(iter(meta.values()))
    lines += ["", f"Held-out greedy accuracy in %, tokens per response and semantic steps (split_steps: ';' and the "
              f"marker 'check') of the greedy held-out responses, mean ± std over seeds. tiny-sums warm-started once on "
              f"checksums4 references with a redundant check after each running total with probability 0.5 (250 steps "
              f"of 64, lr 1e-3, seed 0), then {STEPS} rollout batches of 16 prompts x G = 8, lr 2e-4, 80 new tokens, 300 "
              f"held-out prompts every {EVAL_EVERY} batches; every arm and seed starts from the same warm-started "
              f"policy. A reference without checks has 4 steps and about 25 tokens, each check adds one step and about "
              f"12 tokens. GRPO+LP: --reward correct length:0.5; Step-GRPO: --step-reward 0.5. Train steps: the mean "
              f"semantic steps of the last rollout batch. Hardware: {row['hardware']} (shared); {row['versions']}; "
              f"commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
              f"`python benchmarks/step_grpo_table.py`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--probe-only", action="store_true", help="only measure accuracy by number of checks of the "
                    "warm-started policy (made if missing) and add its rows")
    a = ap.parse_args()
    if a.probe_only:
        append_rows(CSV, NAME, "algos/step_grpo.py", "warm-start probe", 0, probe_checks(warm_policy()))
    elif not a.report_only:
        run(a.seeds, a.arms)
    report()
