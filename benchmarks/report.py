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
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results:([\w\-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)
FILES = (ROOT / "benchmarks" / "README.md", ROOT / "README.md")
POPULATION_STD = {"offline_rl.csv", "world_models.csv"}
CLAIM_FIELDS = ["group", "paper", "claim", "paper_figure", "ours", "direction", "command", "figures", "compare", "kind",
                "margin"]
DIRECTIONS = ("yes", "no", "inconclusive")


# ---- figures from the results CSVs ----
def figure_values(ref: str) -> list[float]:
    """The per-seed values of `file#script#config#metric#scale` (one per (bench, seed); a later row replaces)."""
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
    return vals


def figure(ref: str) -> tuple[float, float, int]:
    """(mean, std, seeds) of `file#script#config#metric#scale` as its table quotes it; std is 0 for a single seed."""
    vals = figure_values(ref)
    if len(vals) == 1:
        return vals[0], 0.0, 1
    sd = statistics.pstdev(vals) if ref.split("#")[0] in POPULATION_STD else statistics.stdev(vals)
    return statistics.mean(vals), sd, len(vals)


def sample_stats(ref: str) -> tuple[float, float, int]:
    """(mean, sample std (n - 1), seeds) of a figure: what the verdict rule uses, whatever std its table quotes."""
    vals = figure_values(ref)
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals)


def fmt(mean: float, sd: float, n: int, digits: int) -> str:
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def parse_figures(spec: str) -> list[tuple[str, int]]:
    """`ref@digits; ref@digits; ...` -> [(ref, digits)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        ref, _, digits = part.rpartition("@")
        out.append((ref, int(digits)))
    return out


# ---- the verdict rule ----
MIN_SEEDS = 3
RULE = """\
**How a verdict is decided.** A row compares two of its figures in the paper's direction (`compare`: i > j, i < j,
or i ~ j for "no change"). Each figure is either *seeded* (a mean over seeds, quoted as mean ± std with the number
of seeds) or *exact* (a deterministic computation, or an estimate over many samples whose standard error is
quoted beside it); the `kind` column says which. The **difference** column gives figure i minus figure j with its
95% interval: for seeded figures Welch's t interval on the difference of the seed means (sample variances,
Welch-Satterthwaite degrees of freedom), for exact figures ± 1.96 times the root sum of their squared standard
errors (no interval when both are deterministic). *i > j*: **yes** when the interval lies above zero, **no** when
it lies below, **inconclusive** otherwise. *i ~ j*: **yes** when the interval lies inside the row's equivalence
margin (± m; written as a percentage it is that share of the larger |mean|), **no** when it lies wholly outside it,
**inconclusive** otherwise. A margin is fixed before the run; rows measured before this rule existed take a uniform
10% of the larger |mean|. A seeded comparison with fewer than 3 seeds in either arm is **inconclusive**
whatever its interval, and a row that compares no two figures is **inconclusive** (it is described in words).
The two arms of a comparison differ in the paper's idea only; where they differ in more, the row says so and a
control arm is measured beside them. A verdict is what happens at this repository's tiny scale, not a judgement
on the paper: the papers train billion-parameter models on real benchmarks.
"""


class Decision(NamedTuple):
    verdict: str
    diff: float  # figure i minus figure j
    lo: float  # 95% interval of the difference; nan when none can be given (a single seed)
    hi: float
    margin: float  # the equivalence margin of a '~' row (nan otherwise)
    note: str  # why the verdict is inconclusive regardless of the interval, if it is ("" otherwise)


def parse_compare(spec: str) -> tuple[int, str, int]:
    m = re.fullmatch(r"(\d+)([<>~])(\d+)", spec.strip())
    if not m:
        raise ValueError(f"compare {spec!r}: expected i>j, i<j or i~j")
    return int(m.group(1)), m.group(2), int(m.group(3))


def parse_kind(kind: str) -> tuple[str, tuple[int | None, int | None]]:
    """`seeded`, `exact`, or `exact se=k,l` (figures k and l are the standard errors of figures i and j; `-` for a
    deterministic one) -> (kind, (k, l))."""
    m = re.fullmatch(r"(seeded|exact)(?:\s+se=(\d+|-),(\d+|-))?", kind.strip())
    if not m or (m.group(1) == "seeded" and m.group(2)):
        raise ValueError(f"kind {kind!r}: expected seeded, exact or exact se=k,l")
    se = tuple(None if g in (None, "-") else int(g) for g in (m.group(2), m.group(3)))
    return m.group(1), se


def parse_margin(margin: str, mi: float, mj: float) -> float:
    """An equivalence margin: a number in the figures' units, or `p%` of the larger |mean|."""
    margin = margin.strip()
    if not margin:
        raise ValueError("a '~' row needs an equivalence margin")
    if margin.endswith("%"):
        return float(margin[:-1]) / 100 * max(abs(mi), abs(mj))
    return float(margin)


def welch_interval(a: tuple[float, float, int], b: tuple[float, float, int], level: float = 0.95) -> tuple[float, float]:
    """Welch's interval for mean(a) - mean(b) from (mean, sample std, n) of each arm (n >= 2 where std > 0)."""
    from scipy import stats

    (ma, sa, na), (mb, sb, nb) = a, b
    va, vb = sa * sa / na, sb * sb / nb
    diff = ma - mb
    if va + vb == 0.0:
        return diff, diff
    dof = (va + vb) ** 2 / ((va * va / (na - 1) if va else 0.0) + (vb * vb / (nb - 1) if vb else 0.0))
    half = stats.t.ppf(0.5 + level / 2, dof) * math.sqrt(va + vb)
    return diff - half, diff + half


def decide(compare: str, kind: str, margin: str, figs: list[tuple[float, float, int]]) -> Decision:
    """The verdict of one row: `figs` are (mean, sample std, seeds) of the row's figures, in order."""
    i, op, j = parse_compare(compare)
    kind_name, (se_i, se_j) = parse_kind(kind)
    (mi, si, ni), (mj, sj, nj) = figs[i], figs[j]
    sign = -1.0 if op == "<" else 1.0
    diff = mi - mj
    m = parse_margin(margin, mi, mj) if op == "~" else math.nan
    if op != "~" and margin.strip():
        raise ValueError("only a '~' row takes an equivalence margin")
    note = ""
    if kind_name == "seeded":
        if min(ni, nj) < 2:
            return Decision("inconclusive", diff, math.nan, math.nan, m, f"{min(ni, nj)} seed")
        lo, hi = welch_interval((mi, si, ni), (mj, sj, nj))
        if min(ni, nj) < MIN_SEEDS:
            note = f"{min(ni, nj)} seeds"
    else:
        se = math.hypot(*(0.0 if k is None else figs[k][0] for k in (se_i, se_j)))
        lo, hi = diff - 1.96 * se, diff + 1.96 * se
    if note:
        verdict = "inconclusive"
    elif op == "~":
        verdict = "yes" if -m <= lo and hi <= m else "no" if lo > m or hi < -m else "inconclusive"
    else:
        a, b = sorted((sign * lo, sign * hi))
        verdict = "yes" if a > 0 else "no" if b < 0 or (a == b == 0) else "inconclusive"
    return Decision(verdict, diff, lo, hi, m, note)


def expected_direction(spec: str, figs: list[tuple[float, float, int]], margin: str = "10%") -> str:
    """The verdict of `decide` for seeded figures (mean, sample std, seeds); '~' takes `margin`."""
    return decide(spec, "seeded", margin if "~" in spec else "", figs).verdict


def fmt_decision(d: Decision, digits: int) -> str:
    """`+1.2 [-0.3, +2.7]` (with `; margin ± m` on '~' rows and why a verdict is held back)."""
    f = lambda x: f"{x:+.{digits}f}"  # noqa: E731
    if math.isnan(d.lo):
        text = f"{f(d.diff)} (no interval)"
    elif d.lo == d.hi:
        text = f"{f(d.diff)} (exact)"
    else:
        text = f"{f(d.diff)} [{f(d.lo)}, {f(d.hi)}]"
    if not math.isnan(d.margin):
        text += f"; margin ± {d.margin:.{digits}f}"
    if d.note:
        text += f"; {d.note}"
    return text


def row_decision(row: dict) -> Decision | None:
    """The decision a claims row's figures imply (None for a row that compares no two figures)."""
    if not row["compare"]:
        return None
    figs = [sample_stats(ref) for ref, _ in parse_figures(row["figures"])]
    return decide(row["compare"], row["kind"], row["margin"], figs)


def row_verdict(row: dict) -> str:
    d = row_decision(row)
    return "inconclusive" if d is None else d.verdict


# ---- the claims table ----
def read_claims() -> list[dict]:
    with open(RESULTS / "claims.csv", newline="") as f:
        return list(csv.DictReader(f))


def claims_table() -> str:
    rows = read_claims()
    lines = [RULE, "| paper | claim | the paper's figure | ours | difference (95% interval) | direction holds | "
             "command |", "|---|---|---|---|---|---|---|"]
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    for r in rows:
        d = row_decision(r)
        if d is None:
            diff = "-"
        else:
            digits = parse_figures(r["figures"])[parse_compare(r["compare"])[0]][1]
            diff = f"{fmt_decision(d, digits)} ({r['kind'].split()[0]})"
        lines.append(f"| {cell(r['paper'])} | {cell(r['claim'])} | {cell(r['paper_figure'])} | {cell(r['ours'])} | "
                     f"{cell(diff)} | **{r['direction']}** | `{r['command']}` |")
    counts = {d: sum(r["direction"] == d for r in rows) for d in DIRECTIONS}
    lines += ["", f"{len(rows)} claims: {counts['yes']} yes, {counts['no']} no, {counts['inconclusive']} inconclusive. "
              "Rows: `benchmarks/results/claims.csv` (its `figures` column names the results rows each figure is "
              "computed from, `compare`, `kind` and `margin` give the rule its inputs, and tests/test_report.py "
              "recomputes every figure and verdict)."]
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
     "predictor {2}; policy ranking in the learned model: Pearson {3} over seven eps-greedy policies, {4} with six "
     "that differ in kind added; verifier-gated chunks (FFDC) need {5} model calls per episode vs {6} with 2-step "
     "chunks when the world is perturbed at 10% of steps",
     ["world_models.csv#live#{\"mode\": \"live\"}#err_h32#1@4", "world_models.csv#diffusion#{}#err_h32#1@4",
      "world_models.csv#ar#{}#err_h32#1@4",
      "world_models.csv#policy-eval#{}#pearson#1@2",
      "world_models.csv#policy-eval-kinds#{\"policies\": [\"0\", \"0.1\", \"0.2\", \"0.35\", \"0.5\", \"0.7\", "
      "\"1\", \"detour=6\", \"detour=9\", \"near=2\", \"near=4\", \"stall=0.5\", \"stall=0.7\"]}#pearson#1@2",
      "ffdc.csv#ffdc#{}#gated_r0.1_calls#1@2", "ffdc.csv#ffdc#{}#short_r0.1_calls#1@2"]),
]


# groups of the claims table; a group joins HEADLINE once its benchmark has figures worth a headline line
GROUPS = [g for g, *_ in HEADLINE] + ["Tree rollouts", "Partial and asynchronous rollouts", "FP8 rollouts",
                                      "Multi-turn agents", "MoE routing replay"]


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
