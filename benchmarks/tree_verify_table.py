"""Token-tree drafts against chain drafts of equal depth: tokens accepted per target call, counted, on the tiny models.

    python benchmarks/tree_verify_table.py                 # 5 arms x 5 seeds, one thread (~2 min)
    python benchmarks/tree_verify_table.py --seeds 0 --only "greedy | chain"   # some runs
    python benchmarks/tree_verify_table.py --report-only   # rebuilds the table from the CSV

The claim (tree-based verification, "SpecInfer: Accelerating Large Language Model Serving with Tree-based
Speculative Inference and Verification", arXiv:2305.09781; the draft-token trees of DART, a parallel drafter whose
trees the target verifies): verifying a TREE of draft tokens in one target forward accepts more tokens per target
call than verifying one chain of the same depth, because a rejected first choice of the drafter can be rescued by a
sibling.

Arms (target tiny-5m, draft tiny-0.6m, `add` with 2-digit operands, 64 held-out prompts per seed drawn from the seed,
one completion each, at most 16 new tokens, draft depth gamma = 4 in every arm, the same gamma draft forwards per
round in every arm):
  chain           algos/_speculative.py's spec_generate with its ModelDrafter (the existing chain path)
  tree b=2 d=2    spec_generate_tree: the draft's top-2 tokens under every node of the first 2 levels, then its top
                  token under every leaf (2 + 4 + 4 + 4 = 14 nodes); the target scores all nodes in one forward
                  with the tree mask (CachedLM.tree_step: a 4-D attention mask built from
                  kernels/tree_verify_attention.ancestor_mask) and keeps the longest accepted path
  tree b=3 d=2    the same with the top 3 (3 + 9 + 9 + 9 = 30 nodes)
Two decoding modes: greedy (acceptance = exact greedy match; every arm's output equals the target's greedy output,
checked per run as greedy_identical) and sampling at temperature 1 (chain: the standard rejection rule with the
draft's q; tree: draw from the target at each node and descend while a child matches, which is plain sampling from
the target because the tree is a deterministic function of the context).
Plan, fixed before the runs: metric = tokens emitted per target call per row (tokens_per_row_call: the accepted path
plus the one emitted token, so mean accepted length + 1); direction = tree b=2 d=2 above chain, greedy; 5 seeds
(each seed its own 64 prompts); verdicts by benchmarks/report.py's rule. Counted, not timed: a wider tree costs a
target forward over more positions (14 or 30 instead of 4), which a GPU's memory-bound decoding step absorbs and a
CPU does not; wall seconds are recorded only to describe.

Writes benchmarks/results/tree_verify.csv and tree_verify.md.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, by_config_seed, mean_std  # noqa: E402

CSV, NAME = "tree_verify.csv", "tree_verify"
SEEDS = (0, 1, 2, 3, 4)
GAMMA, PROMPTS, MAX_NEW = 4, 64, 16
SHAPES = {"chain": None, "tree b=2 d=2": (2, 2), "tree b=3 d=2": (3, 2)}
ARMS = {f"{mode} | {shape}": (mode, shape) for mode in ("greedy", "sample") for shape in SHAPES
        if not (mode == "sample" and shape == "tree b=3 d=2")}
COMMAND = "python benchmarks/tree_verify_table.py"


def _models():
    import common

    target, tok = common.load_model("tiny-5m")
    draft, _ = common.load_model("tiny-0.6m")
    return target.eval(), draft.eval(), tok


def run_arm(models, label: str, seed: int) -> dict:
    import numpy as np
    import torch

    import common
    from algos import _llm as llm
    from algos import _speculative as S

    target, draft, tok = models
    mode, shape = ARMS[label]
    greedy = mode == "greedy"
    examples = llm.make_task("add", 2).sample("test", PROMPTS, np.random.default_rng(seed))
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    args = (target, prompts, 1, MAX_NEW, tok.pad_token_id, tok.eos_token_id)
    drafter = S.ModelDrafter(draft, tok.pad_token_id, 1.0, 1.0, greedy)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if SHAPES[shape] is None:
        comp, _, st, _ = S.spec_generate(*args, drafter=drafter, gamma=GAMMA, greedy=greedy)
    else:
        b, d = SHAPES[shape]
        comp, _, st = S.spec_generate_tree(*args, drafter, GAMMA, b, d, greedy=greedy)
    s = st.summary()
    out = {"tokens_per_row_call": s["tokens_per_row_call"], "mean_accepted": s["mean_accepted"],
           "target_calls": st.target_calls, "row_calls": st.row_calls, "draft_calls": st.draft_calls,
           "nodes_per_round": st.drafted / max(st.rounds_with_draft, 1), "emitted": st.emitted,
           "wall_s": time.perf_counter() - t0}
    if greedy:
        plain, _, _, _ = S.spec_generate(*args, drafter=None, gamma=0, greedy=True)
        out["greedy_identical"] = float(comp == plain)
    return out


def run(seeds, arms) -> None:
    import torch

    torch.set_num_threads(1)
    models = _models()
    for seed in seeds:
        for label in arms:
            figures = {k: v for k, v in run_arm(models, label, seed).items() if math.isfinite(v)}
            append_rows(CSV, NAME, "benchmarks/tree_verify_table.py", label, seed, figures,
                        f"{COMMAND} --seeds {seed} --only \"{label}\"")
            print(label, seed, {k: round(v, 3) for k, v in figures.items()}, flush=True)


def report() -> None:
    by, meta = by_config_seed(CSV)
    fmt = lambda vals, digits=2: mean_std(vals, 1.0, digits, bare_single=False)  # noqa: E731
    lines = ["| decoding | drafts | nodes per round | tokens per target call | accepted per round | batched target "
             "calls | draft calls | greedy output identical | wall s | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, (mode, shape) in ARMS.items():
        runs = list(by.get(label, {}).values())
        if not runs:
            continue
        get = lambda k: [r[k] for r in runs if k in r]  # noqa: E731
        ident = fmt(get("greedy_identical")) if mode == "greedy" else "-"
        lines.append(f"| {mode} | {shape} | {fmt(get('nodes_per_round'), 1)} | {fmt(get('tokens_per_row_call'))} | "
                     f"{fmt(get('mean_accepted'))} | {fmt(get('target_calls'), 1)} | {fmt(get('draft_calls'), 1)} | "
                     f"{ident} | {fmt(get('wall_s'), 1)} | {len(runs)} |")
    if meta:
        row = next(iter(meta.values()))
        lines += ["", f"Mean ± std over seeds (each seed its own {PROMPTS} held-out `add` prompts, 2-digit operands, "
                  f"one completion each, at most {MAX_NEW} new tokens). Target tiny-5m, draft tiny-0.6m, draft depth "
                  f"{GAMMA} in every arm and {GAMMA} draft forwards per round. Tokens per target call = tokens "
                  "emitted per row per target forward (accepted drafts + 1); accepted per round = accepted draft "
                  "tokens per row-round; nodes per round = draft tokens the target scores per row per forward. "
                  "Trees: top-b under every node of the first d levels, then the top token; verified in one "
                  "tree-masked forward; greedy = exact greedy match, sample = temperature 1, both lossless. "
                  f"Counted work; wall seconds describe a shared 2-core CPU. Hardware: {row['hardware']}; "
                  f"{row['versions']}; commit {row['commit']}. Rows: `benchmarks/results/{CSV}`; command: "
                  f"`{COMMAND}`."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--only", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to run")
    a = ap.parse_args()
    if not a.report_only:
        run(a.seeds, a.only)
    report()
