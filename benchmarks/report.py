"""Regenerate the generated sections of benchmarks/README.md and README.md from benchmarks/results/.

Both files hold blocks

    <!-- results:<name> -->
    ...replaced...
    <!-- /results:<name> -->

whose body is generated:
- `<name>` is a results table `benchmarks/results/<name>.md`, written by the benchmark script that made the
  rows of the CSV next to it (each script's docstring gives its command);
- `claims`: the table of paper claims measured here, from `benchmarks/results/claims.csv` (see `claims_table`);
- `headline`: README.md's one-line-per-group summary, computed from the results CSVs (see `HEADLINE`).

`python benchmarks/report.py` rewrites the blocks; `--check` exits 1 when either file is out of date
(tests/test_repo_rules.py runs it).

Figures quoted from a CSV are `mean ± std` over the seeds of one (script, config, metric); a single seed is
quoted alone. The std is the sample std (n - 1), except for offline_rl.csv and world_models.csv, whose
tables use the population std (n); the claims and headline tables follow each file's own table. If one
(bench, script, config, seed, metric) appears twice (a re-measurement), the later row counts.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results:([\w\-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)
FILES = (ROOT / "benchmarks" / "README.md", ROOT / "README.md")
POPULATION_STD = {"offline_rl.csv", "world_models.csv"}
CLAIM_FIELDS = ["group", "paper", "claim", "paper_figure", "ours", "direction", "command", "figures", "compare"]
DIRECTIONS = ("yes", "no", "inconclusive")


# ---- figures from the results CSVs ----
def figure(ref: str) -> tuple[float, float, int]:
    """(mean, std, seeds) of `file#script#config#metric#scale`; std is 0 for a single seed."""
    name, script, config, metric, scale = ref.split("#")
    path = RESULTS / name
    if not path.exists():
        raise ValueError(f"{ref}: no file benchmarks/results/{name}")
    by_seed = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["script"] == script and r["config"] == config and r["metric"] == metric:
                by_seed[(r["bench"], r["seed"])] = float(r["value"]) * float(scale)  # a later row replaces
    vals = list(by_seed.values())
    if not vals:
        raise ValueError(f"{ref}: no rows in benchmarks/results/{name}")
    if len(vals) == 1:
        return vals[0], 0.0, 1
    sd = statistics.pstdev(vals) if name in POPULATION_STD else statistics.stdev(vals)
    return statistics.mean(vals), sd, len(vals)


def fmt(mean: float, sd: float, n: int, digits: int) -> str:
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def parse_figures(spec: str) -> list[tuple[str, int]]:
    """`ref@digits; ref@digits; ...` -> [(ref, digits)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        ref, _, digits = part.rpartition("@")
        out.append((ref, int(digits)))
    return out


def expected_direction(spec: str, figs: list[tuple[float, float, int]]) -> str:
    """The verdict that `compare` ("i>j", "i<j" or "i~j": the paper's direction between figures i and j) implies.

    The noise of a comparison is the larger of the two stds; when either side has a single seed, at least 10% of
    the larger |mean|. '>' / '<': yes if the difference has the paper's sign and exceeds the noise, no if it has
    the opposite sign and exceeds the noise, inconclusive otherwise. '~' (no change expected): yes if the
    difference is within the noise, no otherwise.
    """
    m = re.fullmatch(r"(\d+)([<>~])(\d+)", spec.strip())
    if not m:
        raise ValueError(f"compare {spec!r}: expected i>j, i<j or i~j")
    (mi, si, ni), (mj, sj, nj) = figs[int(m.group(1))], figs[int(m.group(3))]
    noise = max(si, sj)
    if min(ni, nj) == 1:
        noise = max(noise, 0.1 * max(abs(mi), abs(mj)))
    diff = mi - mj
    if m.group(2) == "~":
        return "yes" if abs(diff) <= noise else "no"
    if m.group(2) == "<":
        diff = -diff
    return "yes" if diff > noise else "no" if -diff > noise else "inconclusive"


# ---- the claims table ----
def read_claims() -> list[dict]:
    with open(RESULTS / "claims.csv", newline="") as f:
        return list(csv.DictReader(f))


def claims_table() -> str:
    rows = read_claims()
    lines = ["| paper | claim | the paper's figure | ours | direction holds | command |", "|---|---|---|---|---|---|"]
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    for r in rows:
        lines.append(f"| {cell(r['paper'])} | {cell(r['claim'])} | {cell(r['paper_figure'])} | {cell(r['ours'])} | "
                     f"**{r['direction']}** | `{r['command']}` |")
    counts = {d: sum(r["direction"] == d for r in rows) for d in DIRECTIONS}
    lines += ["", f"{len(rows)} claims: {counts['yes']} yes, {counts['no']} no, {counts['inconclusive']} inconclusive. "
              "Rows: `benchmarks/results/claims.csv` (its `figures` column names the results rows each figure is "
              "computed from, and tests/test_report.py recomputes them)."]
    return "\n".join(lines) + "\n"


# ---- README.md's headline table ----
# (group, section of benchmarks/README.md, template, [figure refs @ digits]); {i} is figure i, formatted.
_DUALKV = "kernels.csv#benchmarks/bench_kernels.py#dualkv_attention B=1 N=16 H=32 P=2048 R=512 D=128 rho=4.00 fwd+bwd"
_FP8 = "kernels.csv#benchmarks/bench_kernels.py#fp8_blockwise M=4096 N=4096 K=4096 fwd"
HEADLINE = [
    ("GRPO and its family", "grpo-and-its-family",
     "`python algos/grpo.py`: held-out accuracy {0} -> {1}; at an equal budget of 10,240 sequences GRPO ends at "
     "{2}, DAPO {3}, GSPO {4}, RLOO {5}, PPO {6}",
     ["foundation.csv#algos/grpo.py#default#eval_acc_start#100@1",
      "foundation.csv#algos/grpo.py#default#eval_acc_end#100@1",
      "grpo_family.csv#algos/grpo.py#GRPO (seq-mean)#eval_acc_end#100@1",
      "grpo_family.csv#algos/dapo.py#DAPO#eval_acc_end#100@1",
      "grpo_family.csv#algos/gspo.py#GSPO#eval_acc_end#100@1",
      "grpo_family.csv#algos/rloo.py#RLOO#eval_acc_end#100@1",
      "grpo_family.csv#algos/ppo.py#PPO#eval_acc_end#100@1"]),
    ("On-policy distillation", "on-policy-distillation",
     "dense bridge from an RL'd teacher {0} vs GRPO on the student {1}; reverse KL on 8-step-stale rollouts {2} "
     "vs forward KL {3}; all-token self-distillation {4}",
     ["opd_bridge.csv#algos/opd.py#grpo-teacher+bridge#eval_acc_end#100@1",
      "opd_bridge.csv#algos/grpo.py#grpo-student#eval_acc_end#100@1",
      "async_opd.csv#algos/async_opd.py#rkl-stale|k=8#eval_acc_end#100@1",
      "async_opd.csv#algos/async_opd.py#fkl|k=8#eval_acc_end#100@1",
      "self_opd.csv#algos/self_opd.py#opsd#eval_acc_end#100@1"]),
    ("Speculative rollouts", "speculative-rollouts",
     "draft model, gamma = 4: {0} tokens per target call (theory {1}); CPU wall-clock ratio {2}x; SPEC-RL "
     "previous-epoch drafts: {3} target forwards per token",
     ["spec_rollout.csv#algos/spec_decode.py#model gamma=4 addsteps tiny-5m#tokens_per_row_call#1@2",
      "spec_rollout.csv#algos/spec_decode.py#model gamma=4 addsteps tiny-5m#tokens_per_call_theory#1@2",
      "spec_rollout.csv#algos/spec_decode.py#model gamma=4 addsteps tiny-5m#speedup_wall#1@2",
      "spec_rollout.csv#algos/spec_rl.py#prev steps=32#row_calls_per_token#1@3"]),
    ("Triton kernels (H200)", "triton-kernels",
     "DualKV attention forward+backward {0} ms vs SDPA on the replicated layout {1} ms; fp8 blockwise matmul "
     "{2} ms vs bf16 {3} ms",
     [f"{_DUALKV} ours triton=3.6.0#median_ms#1@2", f"{_DUALKV} sdpa_replicated triton=3.6.0#median_ms#1@2",
      f"{_FP8} ours triton=3.6.0#median_ms#1@3", f"{_FP8} bf16_matmul triton=3.6.0#median_ms#1@3"]),
    ("Offline RL", "offline-rl",
     "halfcheetah-medium-replay (behaviour {0}): IQL {1}, TD3+BC {2}; RAVL with a learned model {3} vs no "
     "pessimism {4}",
     ["offline_rl.csv#iql#halfcheetah-medium-replay#behaviour_score#1@1",
      "offline_rl.csv#iql#halfcheetah-medium-replay#score_last#1@1",
      "offline_rl.csv#td3_bc#halfcheetah-medium-replay#score_last#1@1",
      "offline_rl.csv#ravl#learned/ravl#score_last#1@1", "offline_rl.csv#ravl#learned/none#score_last#1@1"]),
    ("World models", "world-models",
     "pixel MSE at 4x the training horizon: LIVE {0}, same denoiser without the cycle loss {1}, teacher-forced "
     "predictor {2}; policy ranking in the learned model: Pearson {3}",
     ["world_models.csv#live#{\"mode\": \"live\"}#err_h32#1@4", "world_models.csv#diffusion#{}#err_h32#1@4",
      "world_models.csv#ar#{}#err_h32#1@4",
      "world_models.csv#policy-eval#{}#pearson#1@2"]),
]


# groups of the claims table; a group joins HEADLINE once its benchmark has figures worth a headline line
GROUPS = [g for g, *_ in HEADLINE] + ["Tree rollouts", "Partial and asynchronous rollouts", "FP8 rollouts"]


def headline_table() -> str:
    claims = read_claims()
    lines = ["| group | headline figures (mean ± std over seeds) | paper claims: yes / no / inconclusive |",
             "|---|---|---|"]
    for group, anchor, template, refs in HEADLINE:
        figs = []
        seeds = set()
        for ref, digits in parse_figures(";".join(refs)):
            m, sd, n = figure(ref)
            figs.append(fmt(m, sd, n, digits))
            seeds.add(n)
        seed_txt = ", ".join(f"{n} seeds" if n > 1 else "1 run" for n in sorted(seeds, reverse=True))
        mine = [r["direction"] for r in claims if r["group"] == group]
        verdicts = " / ".join(str(mine.count(d)) for d in DIRECTIONS) if mine else "-"
        lines.append(f"| [{group}](benchmarks/README.md#{anchor}) | {template.format(*figs)} ({seed_txt}) | "
                     f"{verdicts} |")
    return "\n".join(lines) + "\n"


GENERATED = {"claims": claims_table, "headline": headline_table}


# ---- filling the blocks ----
def render(text: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name in GENERATED:
            body = GENERATED[name]()
        else:
            path = RESULTS / f"{name}.md"
            body = path.read_text().rstrip() + "\n" if path.exists() else f"*(no results yet: {path.name})*\n"
            body = body.replace("](benchmarks/results/", "](results/")  # links relative to benchmarks/README.md
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated section is not up to date")
    args = ap.parse_args()
    stale = []
    for path in FILES:
        old = path.read_text()
        new = render(old)
        if new == old:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(new)
            print(f"{path.relative_to(ROOT)}: {len(BLOCK.findall(new))} generated blocks refreshed")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python benchmarks/report.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
