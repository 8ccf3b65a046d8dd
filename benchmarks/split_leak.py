"""Did the shipped models memorise held-out pairs? Accuracy on held-out pairs they saw in training vs pairs they did not.

    python benchmarks/split_leak.py                 # evaluates tiny-0.6m and tiny-5m (about a minute on 2 cores)
    python benchmarks/split_leak.py --report-only   # rebuilds benchmarks/results/split_leak.md from the CSV

`add` and `addsteps` hold out an operand pair when a hash of the *unordered* pair is 0 mod 10, so a held-out
pair's commuted twin is held out too. tiny-0.6m and tiny-5m were trained earlier, when the hash was of the
*ordered* pair: their SFT data could contain pairs that are now held out. This script splits the current held-out
`add` pairs by whether the old rule put them in training and compares greedy accuracy on the two halves. If the
models had memorised their training pairs, the "seen" half would score clearly higher.

Writes benchmarks/results/split_leak.csv and .md; `python benchmarks/report.py` puts the table into
benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import RESULTS, append_rows, read_rows  # noqa: E402

CSV, NAME, MODELS = "split_leak.csv", "split_leak", ("tiny-0.6m", "tiny-5m")


def held_out_before(a: int, b: int) -> bool:
    """The earlier rule: a hash of the ordered pair (a, b)."""
    return int(hashlib.md5(f"{a},{b}".encode()).hexdigest(), 16) % 10 == 0


def run(n: int) -> None:
    import numpy as np
    import torch

    import common
    from algos import _llm as llm

    task = llm.make_task("add", 2)
    examples = common.held_out_sets(task, n)["main"]
    pairs = [tuple(int(x) for x in e.prompt.rstrip("=").split("+")) for e in examples]
    seen = [not held_out_before(a, b) for a, b in pairs]  # in the old training split
    for name in MODELS:
        torch.manual_seed(0)
        model, tok = common.load_model(name)
        hits = []
        for s in range(0, len(examples), 256):
            batch = examples[s:s + 256]
            ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in batch]), 1, 8, greedy=True)
            hits += [task.verify(t, e.answer)[0] for t, e in zip(ro.texts, batch)]
        hits, mask = np.array(hits), np.array(seen)
        append_rows(CSV, NAME, "common.py", name, 0,
                    {"frac_seen": mask.mean(), "acc_all": hits.mean(), "acc_seen": hits[mask].mean(),
                     "acc_unseen": hits[~mask].mean(),
                     "n_seen": int(mask.sum()), "n_unseen": int((~mask).sum())},
                    f"python benchmarks/split_leak.py --n {n}")


def report() -> None:
    latest = {}
    for r in read_rows(CSV):
        latest.setdefault(r["config"], {})[r["metric"]] = r
    lines = ["| model | greedy acc, all | held-out pairs the old split trained on | greedy acc on those | on the others |",
             "|---|---|---|---|---|"]
    for name, m in latest.items():
        v = {k: float(r["value"]) for k, r in m.items()}
        lines.append(f"| `{name}` | {100 * v['acc_all']:.1f}% | {100 * v['frac_seen']:.1f}% ({v['n_seen']:.0f}) | {100 * v['acc_seen']:.1f}% | "
                     f"{100 * v['acc_unseen']:.1f}% ({v['n_unseen']:.0f}) |")
    meta = next(iter(next(iter(latest.values())).values()))
    lines += ["", f"2-digit `add`, the fixed held-out prompts (the same as every script's), greedy. "
              f"Hardware: {meta['hardware']}; commit {meta['commit']}. "
              f"Rows: `benchmarks/results/{CSV}`; command: `{meta['command']}`."]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the CSV")
    ap.add_argument("--n", type=int, default=1000, help="held-out prompts to evaluate")
    a = ap.parse_args()
    if not a.report_only:
        run(a.n)
    report()
