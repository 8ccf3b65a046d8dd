"""Offline RL benchmark: the CORL-style table, the RAVL edge-of-reach table and the DriftQL table.

Runs every configuration for --seeds seeds at one torch thread, appends one row per (run, metric) to
benchmarks/results/offline_rl.csv (with provenance, through benchmarks/_results.append_rows) and writes
the markdown tables that benchmarks/report.py puts into benchmarks/README.md:
    benchmarks/results/offline_rl.md       TD3+BC and IQL on pendulum-medium, halfcheetah-medium and
                                           halfcheetah-medium-replay (other sets with --datasets)
    benchmarks/results/offline_ravl.md     true vs learned dynamics x pessimism none / penalty / ravl
    benchmarks/results/offline_driftql.md  drift vs MSE-BC regulariser on the toy, rho = 0 and 0.5
Budget: about 40 minutes at one uncontended thread (the first halfcheetah run also trains the CEM behaviour
policies, about 2 minutes), so the default dataset list is the medium sets (pass --datasets
pendulum-medium-replay pendulum-expert ... to add more) and pendulum runs are shorter than the scripts'
defaults (steps listed in each table). Runs go seed-major (seed 0 of every table first) and a rerun skips
runs already in the CSV, so an interrupted benchmark resumes.

    python benchmarks/offline_rl_table.py                 # everything (~40 min)
    python benchmarks/offline_rl_table.py --only ravl     # one table
    python benchmarks/offline_rl_table.py --report-only   # rebuild the .md files from the CSV
    python benchmarks/offline_rl_table.py --plan 10 11 12 13 14   # the claims plan's fresh DriftQL seeds
    python benchmarks/offline_rl_table.py --only ravl --plan 10 11 12 13 14 15 16 17 18 19   # ... and RAVL's
    python benchmarks/offline_rl_table.py --only corl --plan 10 11 12 13 14   # ... and TD3+BC's medium-replay row

--plan SEED...: the fresh seeds that benchmarks/claims_plan.csv asks for (DriftQL's drift and MSE regularisers at
rho = 0, rows under the bench `driftql_plan`; with --only ravl, RAVL and no pessimism on the learned model, rows
under the bench `ravl_plan`; with --only corl, TD3+BC on halfcheetah-medium-replay, rows under the bench
`corl_plan`), which the tables leave out: they neither pool with the first runs' seeds nor stand
in for them.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks._results import RESULTS, append_rows, read_rows

CSV = "offline_rl.csv"
CORL_STEPS, RAVL_STEPS, DRIFT_STEPS = 2000, 2000, 1500
CORL_STEPS_BY_ENV = {"pendulum": CORL_STEPS, "halfcheetah": 10_000}  # halfcheetah: 17-d states, 1000-step episodes
CORL_HIDDEN_BY_ENV = {"pendulum": 128, "halfcheetah": 256}  # halfcheetah: the papers' 2 x 256 networks
DEFAULT_DATASETS = ["pendulum-medium", "halfcheetah-medium", "halfcheetah-medium-replay"]


def corl_steps(ds):
    return CORL_STEPS_BY_ENV.get(ds.split("-")[0], CORL_STEPS)


def done_runs():
    """(bench, script, config, seed) already in the CSV: a rerun resumes instead of repeating them."""
    return {(r["bench"], r["script"], r["config"], int(r["seed"])) for r in read_rows(CSV)}


def corl_jobs(seed, datasets, algos=("td3_bc", "iql"), bench="corl"):
    from algos import iql, td3_bc

    mods = {"td3_bc": td3_bc, "iql": iql}
    for ds in datasets:
        steps = corl_steps(ds)
        for name in algos:
            mod = mods[name]
            hidden = CORL_HIDDEN_BY_ENV.get(ds.split("-")[0], 128)
            args = mod.Args(dataset=ds, seed=seed, total_steps=steps, eval_every=steps // 4, hidden=hidden,
                            out_dir=f"runs/bench/{bench}-{name}-{ds}-s{seed}")
            yield (bench, name, ds, seed), mod.main, args, \
                f"python algos/{name}.py --dataset {ds} --seed {seed} --total-steps {steps} --hidden {hidden}"


DATASET_METRICS = ("n_transitions", "n_episodes", "behaviour_return_mean", "behaviour_score", "behaviour_d4rl_score",
                   "ref_random_return", "ref_expert_return")


def record_datasets(datasets, done):
    """One row set per dataset of the CORL table: size, behaviour return and score, reference returns."""
    from algos import _offline_data as D

    for ds in datasets:
        if ("dataset", "algos/_offline_data.py", ds, 0) in done:
            continue
        meta = D.get_dataset(ds)["meta"]
        append_rows(CSV, "dataset", "algos/_offline_data.py", ds, 0,
                    {k: meta[k] for k in DATASET_METRICS if meta.get(k) is not None},
                    command=f"python -c \"from algos import _offline_data as D; print(D.get_dataset('{ds}')['meta'])\"")


def ravl_jobs(seed, models=("true", "learned"), pessimisms=("none", "penalty", "ravl"), bench="ravl"):
    from algos import ravl

    for model in models:
        for pess in pessimisms:
            args = ravl.Args(model=model, pessimism=pess, seed=seed, total_steps=RAVL_STEPS, eval_every=500,
                             out_dir=f"runs/bench/{bench}-{model}-{pess}-s{seed}")
            yield (bench, "ravl", f"{model}/{pess}", seed), ravl.main, args, \
                f"python algos/ravl.py --model {model} --pessimism {pess} --seed {seed} --total-steps {RAVL_STEPS}"


def driftql_jobs(seed, rhos=(0.0, 0.5), bench="driftql"):
    from algos import driftql

    for reg in ("drift", "mse"):
        for rho in rhos:
            args = driftql.Args(reg=reg, rho=rho, seed=seed, total_steps=DRIFT_STEPS, eval_every=500,
                                out_dir=f"runs/bench/{bench}-{reg}-rho{rho}-s{seed}")
            yield (bench, "driftql", f"{reg}/rho{rho}", seed), driftql.main, args, \
                f"python algos/driftql.py --reg {reg} --rho {rho} --seed {seed} --total-steps {DRIFT_STEPS}"


def run(only, seeds, datasets, plan: bool = False):
    """Seed-major order (every table's seed 0 first), skipping runs already in the CSV; `plan`: DriftQL at rho = 0
    under the bench driftql_plan, RAVL and no pessimism on the learned model under the bench ravl_plan, or TD3+BC on
    halfcheetah-medium-replay under the bench corl_plan."""
    done = done_runs()
    if only in (None, "corl") and not plan:
        record_datasets(datasets, done)
    for seed in seeds:
        if plan:
            gens = {"driftql": driftql_jobs(seed, (0.0,), "driftql_plan"),
                    "ravl": ravl_jobs(seed, ("learned",), ("none", "ravl"), "ravl_plan"),
                    "corl": corl_jobs(seed, ["halfcheetah-medium-replay"], ("td3_bc",), "corl_plan")}
        else:
            gens = {"corl": corl_jobs(seed, datasets), "ravl": ravl_jobs(seed), "driftql": driftql_jobs(seed)}
        for table, jobs in gens.items():
            if only not in (None, table):
                continue
            for key, fn, args, command in jobs:
                if key in done:
                    continue
                append_rows(CSV, key[0], key[1], key[2], seed, fn(args), command=command)
                report()


# ---- report ----
def latest(rows):
    """Keep the newest value of each (bench, script, config, seed, metric)."""
    best = {}
    for r in rows:
        k = (r["bench"], r["script"], r["config"], r["seed"], r["metric"])
        if k not in best or r["timestamp"] >= best[k]["timestamp"]:
            best[k] = r
    table = defaultdict(lambda: defaultdict(list))  # (bench, script, config) -> metric -> [values]
    meta = {}
    for (b, s, c, seed, m), r in sorted(best.items()):
        table[(b, s, c)][m].append(float(r["value"]))
        meta[(b, s, c)] = r
    return table, meta


def ms(vals, fmt="{:.1f}"):
    if not vals:
        return "-"
    v = np.array(vals)
    return (fmt + " ± " + fmt).format(v.mean(), v.std()) if len(v) > 1 else fmt.format(v.mean())


def footer(meta_rows):
    r = next(iter(meta_rows.values()))
    return (f"\n*{r['hardware']}, {r['versions']}, commit {r['commit']}, rows in "
            f"`benchmarks/results/{CSV}`. Scores are normalised to this project's own random (0) and expert (100) "
            f"reference policies on locally generated data, not D4RL; mean ± std over seeds.*\n")


def plan_run_lines(table, meta, bench: str, cols: list[tuple[str, str, str]]) -> list[str]:
    """The claims plan's fresh run under `bench` (run with --plan) as a table of its own: its seeds neither pool with
    the first run's nor stand in for them. `cols`: (header, metric, number format)."""
    runs = {c: m for (b, _, c), m in table.items() if b == bench}
    if not runs:
        return []
    commits = ", ".join(sorted({r["commit"] for k, r in meta.items() if k[0] == bench}))
    lines = ["", f"The claims plan's fresh run (bench `{bench}`, `--plan` seeds, benchmarks/claims_plan.csv; commit "
             f"{commits}):", "",
             "| configuration | " + " | ".join(h for h, _, _ in cols) + " | seeds |", "|---" * (len(cols) + 2) + "|"]
    for c, m in sorted(runs.items()):
        lines.append(f"| {c} | " + " | ".join(ms(m[k], f) if m.get(k) else "-" for _, k, f in cols)
                     + f" | {len(m['score_last'])} |")
    return lines


def corl_md(table, meta) -> str | None:
    """The CORL-style table of TD3+BC and IQL (and the datasets), with its fresh run."""
    corl = {k: v for k, v in table.items() if k[0] == "corl"}
    if not corl:
        return None
    lines = ["Offline RL baselines. Pendulum: 2,000 gradient steps, 2 x 128 networks, 20k transitions; "
             "halfcheetah: 10,000 steps, 2 x 256 networks, 50k (medium) or 115k (medium-replay) transitions. "
             "Score = this project's normalised "
             "score (0 = uniform random actions, 100 = its own expert); D4RL score = the same return on "
             "D4RL's halfcheetah scale (random -280, expert 12,135), *indicative only*: our expert is a "
             "linear CEM policy far below D4RL's, and the data are not D4RL's.", "",
             "| dataset | script | steps | behaviour score | score last | score best | return last | "
             "D4RL score (indicative) | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (_, s, c), m in sorted(corl.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        d4rl = ms(m["return_d4rl_last"]) if m.get("return_d4rl_last") else "n/a (no D4RL pendulum)"
        lines.append(f"| {c} | {s} | {corl_steps(c)} | {ms(m['behaviour_score'])} | {ms(m['score_last'])} | "
                     f"{ms(m['score_best'])} | {ms(m['return_last'], '{:.0f}')} | {d4rl} | "
                     f"{len(m['score_last'])} |")
    data = {k: v for k, v in table.items() if k[0] == "dataset"}
    if data:
        lines += ["", "The datasets (`algos/_offline_data.py`, generator seed 0):", "",
                  "| dataset | transitions | episodes | behaviour return | behaviour score | D4RL score "
                  "(indicative) | reference returns: random / expert |", "|---|---|---|---|---|---|---|"]
        for (_, _, c), m in sorted(data.items()):
            d4rl = ms(m["behaviour_d4rl_score"]) if m.get("behaviour_d4rl_score") else "n/a"
            lines.append(f"| {c} | {ms(m['n_transitions'], '{:.0f}')} | {ms(m['n_episodes'], '{:.0f}')} | "
                         f"{ms(m['behaviour_return_mean'], '{:.0f}')} | {ms(m['behaviour_score'])} | {d4rl} | "
                         f"{ms(m['ref_random_return'], '{:.0f}')} / {ms(m['ref_expert_return'], '{:.0f}')} |")
    lines += plan_run_lines(table, meta, "corl_plan",
                            [("behaviour score", "behaviour_score", "{:.1f}"),
                             ("score last", "score_last", "{:.1f}"),
                             ("score best", "score_best", "{:.1f}")])
    return "\n".join(lines) + "\n" + footer({k: meta[k] for k in corl})


def ravl_md(table, meta) -> str | None:
    """RAVL's edge-of-reach table, with its fresh run."""
    rv = {k: v for k, v in table.items() if k[0] == "ravl"}
    if not rv:
        return None
    lines = [f"Edge-of-reach on pendulum-expert: k = 5 model rollouts, real-data ratio 0.05, {RAVL_STEPS} steps, TD3-style agent. "
             "Q - MC = critic value minus the Monte-Carlo return of the same policy in the true dynamics, "
             "on edge-of-reach states (last states of rollouts) and on dataset states.", "",
             "| model | pessimism | critics | penalty | score last | score best | Q - MC edge (last) | "
             "Q - MC data (last) | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {"none": 0, "penalty": 1, "ravl": 2}
    for (_, s, c), m in sorted(rv.items(), key=lambda kv: (kv[0][2].split("/")[0] != "true",
                                                            order[kv[0][2].split("/")[1]])):
        model, pess = c.split("/")
        lines.append(f"| {model} | {pess} | {ms(m['n_critics'], '{:.0f}')} | {ms(m['penalty_mean_last'], '{:.3f}')} | "
                     f"{ms(m['score_last'])} | {ms(m['score_best'])} | {ms(m['q_edge_minus_mc_last'])} | "
                     f"{ms(m['q_data_minus_mc_last'])} | {len(m['score_last'])} |")
    lines += plan_run_lines(table, meta, "ravl_plan",
                            [("score last", "score_last", "{:.1f}"),
                             ("score best", "score_best", "{:.1f}"),
                             ("Q - MC edge (last)", "q_edge_minus_mc_last", "{:.1f}")])
    return "\n".join(lines) + "\n" + footer({k: meta[k] for k in rv})


def driftql_md(table, meta) -> str | None:
    """DriftQL's table of the two regularisers, with its fresh run."""
    dq = {k: v for k, v in table.items() if k[0] == "driftql"}
    if not dq:
        return None
    lines = [f"DriftQL on toy-multimodal ({DRIFT_STEPS} steps). Goals: fraction of 100 evaluation episodes "
             "ending at the left / right goal. Start-state actions: fraction of 512 sampled actions within "
             "0.3 of the left / right data mode (the rest are between modes or elsewhere).", "",
             "| regulariser | rho | score last | score best | goal left | goal right | "
             "actions at left mode | actions at right mode | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (_, s, c), m in sorted(dq.items(), key=lambda kv: kv[0][2]):
        reg, rho = c.split("/")
        lines.append(f"| {reg} | {rho[3:]} | {ms(m['score_last'])} | {ms(m['score_best'])} | "
                     f"{ms(m['goal_left'], '{:.2f}')} | {ms(m['goal_right'], '{:.2f}')} | "
                     f"{ms(m['left'], '{:.2f}')} | {ms(m['right'], '{:.2f}')} | {len(m['score_last'])} |")
    drops = []
    for reg in ("drift", "mse"):
        a, b = table.get(("driftql", "driftql", f"{reg}/rho0.0")), table.get(("driftql", "driftql", f"{reg}/rho0.5"))
        if a and b:
            drops.append(f"{reg}: {np.mean(a['score_last']) - np.mean(b['score_last']):.1f}")
    if drops:
        lines += ["", "Score drop from rho 0 to rho 0.5 (score last, mean): " + "; ".join(drops) + "."]
    lines += plan_run_lines(table, meta, "driftql_plan",
                            [("score last", "score_last", "{:.1f}"),
                             ("actions at left mode", "left", "{:.2f}"),
                             ("actions at right mode", "right", "{:.2f}")])
    return "\n".join(lines) + "\n" + footer({k: meta[k] for k in dq})


def report():
    table, meta = latest(read_rows(CSV))
    out = {}
    for name, make in (("offline_rl", corl_md), ("offline_ravl", ravl_md), ("offline_driftql", driftql_md)):
        text = make(table, meta)
        if text is not None:
            out[name] = text
    for name, text in out.items():
        (RESULTS / f"{name}.md").write_text(text)
        print(f"wrote benchmarks/results/{name}.md")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["corl", "ravl", "driftql"], help="run one table only")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per configuration (>= 1)")
    ap.add_argument("--datasets", nargs="+", default=DEFAULT_DATASETS,
                    help="datasets of the CORL-style table")
    ap.add_argument("--report-only", action="store_true", help="rebuild the .md files from the CSV")
    ap.add_argument("--plan", type=int, nargs="+", metavar="SEED",
                    help="the claims plan's fresh run at these seeds: DriftQL's two regularisers at rho = 0 (bench "
                         "driftql_plan), with --only ravl RAVL and no pessimism on the learned model (ravl_plan), "
                         "with --only corl TD3+BC on halfcheetah-medium-replay (corl_plan)")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if not args.report_only:
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("WANDB_MODE", "offline")
        only = (args.only or "driftql") if args.plan else args.only
        run(only, args.plan or list(range(args.seeds)), args.datasets, bool(args.plan))
    report()


if __name__ == "__main__":
    main()
