"""Regenerate the generated sections of benchmarks/README.md and README.md from benchmarks/results/.

Both files hold blocks

    <!-- results:<name> -->
    ...replaced...
    <!-- /results:<name> -->

whose body is generated:
- `<name>` is a results table `benchmarks/results/<name>.md`, written by the benchmark script that made the
  rows of the CSV next to it (each script's docstring gives its command);
- `claims`: the table of paper claims measured here, from `benchmarks/results/claims.csv` judged under the plans of
  `benchmarks/claims_plan.csv` (see `RULE` and `judge`);
- `headline`: README.md's one-line-per-group summary, computed from the results CSVs (see `HEADLINE`).

`python benchmarks/report.py` rewrites the blocks; `--check` exits 1 when either file is out of date
(tests/test_repo_rules.py runs it). Both list the claims rows whose `direction` is not the verdict the rule gives now:
the multiplicity step spans the table, so a new or re-measured row can move another row's verdict.

Every claims row needs a line in `benchmarks/claims_plan.csv` (`PLAN_FIELDS`), written before its runs: the test,
the effect or margin with its justification, and the seeds per arm, `seeds_needed(op, effect, (sd_i, sd_j))` at a
pilot's spreads (at least MIN_SEEDS, at most `plan_afford(p)`; the pilot's effect, spreads and seeds go in `pilot`).

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
VERDICTS = ("yes", "no", "inconclusive", "underpowered")  # the verdicts a judged row can get
DIRECTIONS = VERDICTS + ("descriptive",)  # the values of claims.csv's `direction` column


# ---- figures from the results CSVs ----
def figure_values(ref: str) -> list[float]:
    """The per-seed values of `file#script#config#metric#scale` (one per (bench, seed); a later row replaces).
    Optional filters after the scale select a plan's fresh runs from a CSV that also holds older ones:
    `#bench=NAME` (rows of that bench only) and `#seeds=A-B` (seeds A to B, both included); `#minus=METRIC` makes
    each value the change from another metric of the same run (metric minus METRIC, seed by seed, both scaled), so a
    row can compare how much each arm moved from its own start."""
    return list(figure_by_seed(ref).values())


def figure_by_seed(ref: str) -> dict[tuple[str, int], float]:
    """`figure_values` keyed by (bench, seed)."""
    name, script, config, metric, scale, *filters = ref.split("#")
    keep = dict(f.split("=", 1) for f in filters)
    if set(keep) - {"bench", "seeds", "minus"}:
        raise ValueError(f"{ref}: unknown filter {sorted(set(keep) - {'bench', 'seeds', 'minus'})} "
                         "(bench=NAME, seeds=A-B, minus=METRIC)")
    if "minus" in keep:  # the change from another metric of the same runs: both must exist for every run
        now, start = (figure_by_seed("#".join([name, script, config, m, scale] +
                                              [f"{k}={v}" for k, v in keep.items() if k != "minus"]))
                      for m in (metric, keep["minus"]))
        if now.keys() != start.keys():
            raise ValueError(f"{ref}: {metric} and {keep['minus']} were not recorded by the same runs")
        return {key: now[key] - start[key] for key in now}
    lo, hi = map(int, keep["seeds"].split("-")) if "seeds" in keep else (-math.inf, math.inf)
    path = RESULTS / name
    if not path.exists():
        raise ValueError(f"{ref}: no file benchmarks/results/{name}")
    by_seed = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["script"] == script and r["config"] == config and r["metric"] == metric \
                    and keep.get("bench", r["bench"]) == r["bench"] and lo <= int(r["seed"]) <= hi:
                by_seed[(r["bench"], int(r["seed"]))] = float(r["value"]) * float(scale)  # a later row replaces
    if not by_seed:
        raise ValueError(f"{ref}: no rows in benchmarks/results/{name}")
    return by_seed


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


def paired_stats(ref_i: str, ref_j: str) -> tuple[float, float, int]:
    """(mean, sample std, seeds) of figure i minus figure j seed by seed: a `paired` row's two arms ran the same seeds
    (the same initial policy, data and evaluation set, or the same rollouts), so seed k of one arm is paired with seed
    k of the other."""
    rows = [figure_by_seed(ref) for ref in (ref_i, ref_j)]
    a, b = ({seed: v for (_, seed), v in r.items()} for r in rows)
    if a.keys() != b.keys() or (len(a), len(b)) != tuple(map(len, rows)):  # a seed twice (two benches) has no pair
        raise ValueError(f"a paired row needs the same seeds, once each, in both arms: {ref_i} and {ref_j}")
    diffs = [a[seed] - b[seed] for seed in sorted(a)]
    return statistics.mean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0, len(diffs)


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
MIN_SEEDS = 3  # the fewest seeds per arm a seeded comparison is decided on
MAX_SEEDS = 10  # the most seeds per arm one row's plan can afford on the 2-core machine, unless a seed is quick:
ROW_CORE_HOURS = 2.5  # then as many as this much of one core buys at the pilot's `seed_s=` (see plan_afford)
POWER = 0.8  # the power a plan's seeds aim for
FDR = 0.05  # Benjamini-Hochberg level across the directional rows
PLAN = ROOT / "benchmarks" / "claims_plan.csv"
PLAN_FIELDS = ["arxiv", "claim", "command", "metric", "test", "effect", "justification", "seeds", "pilot",
               "seeds_needed", "status", "redecide", "note"]
RULE = """\
**How a verdict is decided.** Every row has a plan, a line of `benchmarks/claims_plan.csv` keyed by the paper's arXiv
id, the claim and the command, fixed before the runs it governs. It names the metric and the test: figure i > j or
i < j in the paper's direction, or i ~ j for "no change". For a directional row it gives the effect δ the
measurement must be able to detect; for a "~" row, the equivalence margin ± m. Both come from the paper, or are a
stated fraction of the effect the method is meant to have, never from our own results (written as a percentage,
they are that share of the larger |mean|). The plan also gives the seeds per arm, from a power estimate: the fewest
seeds (at least {min_seeds}; at most what one row can afford here: {max_seeds}, or as many as {core_hours} hours of one
core buy where a seed of both arms took under {cheap_s} seconds in the row's earlier run, seconds the plan records
as `seed_s=`; one hour for the plans written before the third run of FP8 TIS against fp32 rollouts) that give 80%
power at a two-sided level of 0.05 (Welch's t at the pilot's sample spreads, which the plan records; for a *paired*
row, Student's t at the spread of the pilot's per-seed differences) to detect δ, or to place the interval inside ± m
when the true difference is zero. The plan is `measured` when the figures below are its
measurement, and `planned` when it calls for a fresh run with more seeds than the figures have. Rows measured before
the plans existed ran with the seeds their scripts fixed before the runs (3 per arm for most): their figures decide
such a row until the planned run replaces them, whatever that run finds. A row whose plan says `redecide` (its margin
was set after its run, or it had no comparison) is decided by fresh seeds only. A claim gets at most three runs on
seeds of its own; the plan's note says which one a run is, since each repeat adds to the chance of a false verdict.

Each figure is either *seeded* (a mean over seeds, quoted as mean ± std with the number of seeds) or *exact* (a
deterministic computation, or an estimate over many samples whose standard error is quoted beside it); the `kind`
column says which, and *paired* marks seeded figures whose two arms ran the same seeds (the same initial policy, data
and evaluation set, or the same rollouts), so that seed k of one arm is compared with seed k of the other; the plan
says so before the run. The **difference** column gives figure i minus figure j with its 95% interval: Welch's t
interval for seeded figures, Student's t interval on the per-seed differences for paired ones, ± 1.96 times the root
sum of the squared standard errors for exact ones (no interval when both are deterministic). **p** is the two-sided
p-value of that difference (Welch's t test; the paired t test; a z test for exact figures) and **q** its
Benjamini-Hochberg adjustment over all {family} directional rows with a p-value.

Verdicts. A directional row is **yes** when q ≤ 0.05 and the difference points the paper's way. It is **no** when q ≤
0.05 and it points the other way, or when its q short of δ is ≤ 0.05: the measurement rules out the effect its plan
was powered to see, though a smaller one may remain ({short_no} of the {no} no rows say no this way only). A plan's
seeds serve both tests alike: before the multiplicity step, 80% power to see δ when the true difference is δ is also
80% power to rule δ out when it is 0. A row that is yes and also short of δ stays yes: its direction holds, with a
smaller effect than the plan's. A "~" row (no multiplicity step) is **yes** when the 95% interval lies inside ± m and
**no** when it lies wholly outside. A row that is neither is **underpowered** when its planned seeds give less than
80% power at the observed spread (the plan column gives the seeds per arm that 80% would need), and **inconclusive**
otherwise (a `planned` row then waits for its run). The test against δ joined the rule after most of the plans' runs;
it uses only the δ each plan fixed before them. A row cannot be yes or no when it has fewer than {min_seeds} seeds in
an arm, when it is to be re-decided on fresh seeds, or when it departs from its plan (seeds, test or margin differ
from it; the plan column says how). **Descriptive** rows are outside the count: a figure that is not a comparison (a
ranking, a formula check, one GPU timing), seconds on a shared 2-core CPU (restated in counted work, such as forward
passes, token positions or network evaluations, where the results CSVs hold it), steps to reach a target quantised to
the evaluation interval (the plan names the area under the curve instead), or counted work fixed by the
configuration. The two arms of a comparison differ in the paper's idea only; where they differ in more, the row says
so and a control arm is measured beside them. A verdict is what happens at this repository's tiny scale, not a
judgement on the paper: the papers train billion-parameter models on real benchmarks.
"""


class Decision(NamedTuple):
    verdict: str
    diff: float  # figure i minus figure j
    lo: float  # 95% interval of the difference; nan when none can be given (a single seed)
    hi: float
    margin: float  # the equivalence margin of a '~' row (nan otherwise)
    note: str  # why the verdict is inconclusive regardless of the interval, if it is ("" otherwise)
    p: float = math.nan  # two-sided p-value of the difference (nan on '~' rows and where no interval exists)
    se: float = math.nan  # standard error of the difference (nan where no interval exists)
    dof: float = math.inf  # its degrees of freedom (inf: the normal)


def parse_compare(spec: str) -> tuple[int, str, int]:
    m = re.fullmatch(r"(\d+)([<>~])(\d+)", spec.strip())
    if not m:
        raise ValueError(f"compare {spec!r}: expected i>j, i<j or i~j")
    return int(m.group(1)), m.group(2), int(m.group(3))


def parse_kind(kind: str) -> tuple[str, tuple[int | None, int | None]]:
    """`seeded`, `paired` (seeded figures whose arms ran the same seeds: the test is on the per-seed differences),
    `exact`, or `exact se=k,l` (figures k and l are the standard errors of figures i and j; `-` for a deterministic
    one) -> (kind, (k, l))."""
    m = re.fullmatch(r"(seeded|paired|exact)(?:\s+se=(\d+|-),(\d+|-))?", kind.strip())
    if not m or (m.group(1) != "exact" and m.group(2)):
        raise ValueError(f"kind {kind!r}: expected seeded, paired, exact or exact se=k,l")
    se = tuple(None if g in (None, "-") else int(g) for g in (m.group(2), m.group(3)))
    return m.group(1), se


def parse_margin(margin: str, mi: float, mj: float) -> float:
    """An equivalence margin or a plan's effect: a number in the figures' units, or `p%` of the larger |mean|."""
    margin = margin.strip()
    if not margin:
        raise ValueError("a '~' row needs an equivalence margin")
    if margin.endswith("%"):
        return float(margin[:-1]) / 100 * max(abs(mi), abs(mj))
    return float(margin)


def welch_se_dof(a: tuple[float, float, int], b: tuple[float, float, int]) -> tuple[float, float]:
    """Standard error of mean(a) - mean(b) and its Welch-Satterthwaite degrees of freedom (inf when both spreads are
    0)."""
    (_, sa, na), (_, sb, nb) = a, b
    va, vb = sa * sa / na, sb * sb / nb
    if va + vb == 0.0:
        return 0.0, math.inf
    dof_den = (va * va / (na - 1) if va else 0.0) + (vb * vb / (nb - 1) if vb else 0.0)
    return math.sqrt(va + vb), (va + vb) ** 2 / dof_den


def welch_interval(a: tuple[float, float, int], b: tuple[float, float, int],
                   level: float = 0.95) -> tuple[float, float]:
    """Welch's interval for mean(a) - mean(b) from (mean, sample std, n) of each arm (n >= 2 where std > 0)."""
    return t_interval(a[0] - b[0], *welch_se_dof(a, b), level)  # se 0: dof inf, the interval is the point


def paired_se_dof(sd_d: float, n: int) -> tuple[float, float]:
    """Standard error of the mean of n per-seed differences with sample std `sd_d`, and its degrees of freedom (inf when
    the differences do not vary)."""
    return sd_d / math.sqrt(n), (n - 1 if sd_d else math.inf)


def t_crit(dof: float, level: float = 0.95) -> float:
    """The two-sided `level` critical value of Student's t with `dof` (the normal's when inf)."""
    from scipy import stats

    return float(stats.norm.ppf(0.5 + level / 2) if math.isinf(dof) else stats.t.ppf(0.5 + level / 2, dof))


def t_interval(diff: float, se: float, dof: float, level: float = 0.95) -> tuple[float, float]:
    """The `level` interval of `diff` with standard error `se`: Student's t with `dof`, the normal when inf."""
    half = t_crit(dof, level) * se
    return diff - half, diff + half


def two_sided_p(diff: float, se: float, dof: float = math.inf) -> float:
    """p-value of `diff` against 0 with standard error `se` (Student's t with `dof`, the normal when inf)."""
    from scipy import stats

    if se == 0.0:
        return 0.0 if diff else 1.0
    z = abs(diff) / se
    return float(2 * (stats.norm.sf(z) if math.isinf(dof) else stats.t.sf(z, dof)))


def decide(compare: str, kind: str, margin: str, figs: list[tuple[float, float, int]],
           paired: tuple[float, float, int] | None = None) -> Decision:
    """The interval verdict of one comparison taken alone (before the claims table's plan and multiplicity step):
    `figs` are (mean, sample std, seeds) of the row's figures, in order; a `paired` row also takes `paired`, the
    (mean, sample std, seeds) of figure i minus figure j seed by seed (`paired_stats`), and its interval is Student's
    t on those differences."""
    i, op, j = parse_compare(compare)
    kind_name, (se_i, se_j) = parse_kind(kind)
    (mi, si, ni), (mj, sj, nj) = figs[i], figs[j]
    sign = -1.0 if op == "<" else 1.0
    diff = mi - mj
    m = parse_margin(margin, mi, mj) if op == "~" else math.nan
    if op != "~" and margin.strip():
        raise ValueError("only a '~' row takes an equivalence margin")
    note = ""
    if kind_name == "paired":
        if paired is None:
            raise ValueError("a paired row needs its per-seed differences (paired_stats)")
        diff, sd_d, n = paired
        if n < 2:
            return Decision("inconclusive", diff, math.nan, math.nan, m, "1 seed")
        se, dof = paired_se_dof(sd_d, n)
        lo, hi = t_interval(diff, se, dof)
        if n < MIN_SEEDS:
            note = f"{n} seeds"
    elif kind_name == "seeded":
        if min(ni, nj) < 2:
            return Decision("inconclusive", diff, math.nan, math.nan, m, f"{min(ni, nj)} seed")
        lo, hi = welch_interval((mi, si, ni), (mj, sj, nj))
        se, dof = welch_se_dof((mi, si, ni), (mj, sj, nj))
        if min(ni, nj) < MIN_SEEDS:
            note = f"{min(ni, nj)} seeds"
    else:
        se, dof = math.hypot(*(0.0 if k is None else figs[k][0] for k in (se_i, se_j))), math.inf
        lo, hi = diff - 1.96 * se, diff + 1.96 * se
    p = math.nan if op == "~" else two_sided_p(diff, se, dof)
    if note:
        verdict = "inconclusive"
    elif op == "~":
        verdict = "yes" if -m <= lo and hi <= m else "no" if lo > m or hi < -m else "inconclusive"
    else:
        a, b = sorted((sign * lo, sign * hi))
        verdict = "yes" if a > 0 else "no" if b < 0 or (a == b == 0) else "inconclusive"
    return Decision(verdict, diff, lo, hi, m, note, p, se, dof)


def describe_comparison(spec: str, figs: list[tuple[float, float, int]], digits: int = 1, margin: str = "") -> str:
    """One comparison of seeded figures taken alone, described rather than judged, for a results table's prose: the
    difference (figure i minus figure j), its Welch 95% interval and where the interval lies (for '~', against
    `margin`, or against 0 when no margin is given). Whether a paper's claim holds is the claims table's verdict, which
    adds a plan, fresh seeds and the multiplicity step (`judge`)."""
    plain = "~" in spec and not margin
    d = decide(spec.replace("~", ">") if plain else spec, "seeded", margin, figs)
    if d.note or math.isnan(d.lo):
        return f"{fmt_decision(d._replace(note=''), digits)} ({d.note or 'one seed'} in an arm, too few to place it)"
    if plain:
        where = {"yes": "clear of 0", "no": "clear of 0", "inconclusive": "0 inside"}
    elif "~" in spec:
        where = {"yes": "inside the margin", "no": "outside the margin", "inconclusive": "across the margin's edge"}
    else:
        where = {"yes": "clear of 0 the claimed way", "no": "clear of 0 the other way", "inconclusive": "0 inside"}
    return f"{fmt_decision(d, digits)}, {where[d.verdict]}"


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
    figs, paired = row_stats(row)
    return decide(row["compare"], row["kind"], row["margin"], figs, paired)


def row_stats(row: dict) -> tuple[list[tuple[float, float, int]], tuple[float, float, int] | None]:
    """(mean, sample std, seeds) of each figure of a claims row, and of the compared figures' per-seed differences
    on a `paired` row (None otherwise)."""
    refs = [ref for ref, _ in parse_figures(row["figures"])]
    paired = None
    if row["compare"] and parse_kind(row["kind"])[0] == "paired":
        i, _, j = parse_compare(row["compare"])
        paired = paired_stats(refs[i], refs[j])
    return [sample_stats(ref) for ref in refs], paired


# ---- power and multiplicity ----
def power(op: str, effect: float, sds: tuple[float, ...], ns: tuple[int, int], level: float = 0.95) -> float:
    """Chance that a seeded row with `ns` seeds per arm and sample spreads `sds` is decided: for '>' or '<' that the
    two-sided Welch test at 1 - level rejects when the true difference is `effect` (noncentral t); for '~' that the
    interval lies inside ± `effect` when the true difference is 0 (t approximation). 0 below MIN_SEEDS seeds.
    A paired row gives one spread, `(sd_d,)`, that of its per-seed differences: the test is then Student's t on
    them."""
    from scipy import stats

    if min(ns) < MIN_SEEDS:
        return 0.0
    if len(sds) == 1:
        se, dof = paired_se_dof(sds[0], ns[0])
    else:
        se, dof = welch_se_dof((0.0, sds[0], ns[0]), (0.0, sds[1], ns[1]))
    if se == 0.0:
        return 1.0 if effect > 0 else 0.0
    tcrit = t_crit(dof, level)
    if op == "~":
        return max(0.0, float(2 * stats.t.cdf(effect / se - tcrit, dof) - 1))
    ncp = effect / se
    value = float(stats.nct.sf(tcrit, dof, ncp) + stats.nct.cdf(-tcrit, dof, ncp))
    return value if math.isfinite(value) else float(stats.norm.sf(tcrit - ncp))  # scipy's nct fails far out in the tail


def exact_power(op: str, effect: float, se: float) -> float:
    """`power` for exact figures whose difference has standard error `se` (normal; 1 for deterministic figures)."""
    from scipy import stats

    if se == 0.0:
        return 1.0 if effect > 0 else 0.0
    if op == "~":
        return max(0.0, float(2 * stats.norm.cdf(effect / se - 1.96) - 1))
    return float(stats.norm.sf(1.96 - effect / se) + stats.norm.cdf(-1.96 - effect / se))


def seeds_needed(op: str, effect: float, sds: tuple[float, ...], limit: int = 100_000) -> int | None:
    """The fewest seeds per arm (alike in both arms, at least MIN_SEEDS) whose `power` reaches POWER at these spreads
    (one spread: a paired row's per-seed differences); None above `limit`."""
    lo = hi = MIN_SEEDS
    if power(op, effect, sds, (lo, lo)) >= POWER:
        return lo
    while power(op, effect, sds, (hi, hi)) < POWER:
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:  # power(lo) < POWER <= power(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(op, effect, sds, (mid, mid)) >= POWER else (mid, hi)
    return hi


def shortfall_p(d: Decision, op: str, effect: float) -> float:
    """p-value of a directional row's difference against the plan's effect δ instead of 0, counted only where the
    difference falls short of δ in the paper's direction (1 where it reaches δ): below 0.05 exactly when the 95%
    interval lies wholly short of δ, so that the measurement rules out the effect its plan was powered to see."""
    gap = (-d.diff if op == "<" else d.diff) - effect
    return 1.0 if gap >= 0 else two_sided_p(gap, d.se, d.dof)


def bh_adjust(ps: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values) of `ps`: reject at level FDR every row with q <= FDR."""
    m = len(ps)
    order = sorted(range(m), key=lambda k: ps[k])
    qs, running = [math.nan] * m, 1.0
    for rank in range(m, 0, -1):
        k = order[rank - 1]
        running = min(running, ps[k] * m / rank)
        qs[k] = running
    return qs


# ---- the plan ----
def claim_key(row: dict) -> tuple[str, str, str]:
    """A claims row's key in the plan: (arXiv id, claim, command)."""
    m = re.search(r"arXiv:(\d{4}\.\d{4,5})", row["paper"])
    return (m.group(1) if m else row["paper"], row["claim"], row["command"])


def read_plan(path: Path | None = None) -> dict[tuple[str, str, str], dict]:
    """benchmarks/claims_plan.csv by key; a malformed line raises a ValueError naming it."""
    with open(path or PLAN, newline="") as f:
        lines = list(csv.DictReader(f))
    plan = {}
    for n, p in enumerate(lines, 2):
        key = (p["arxiv"], p["claim"], p["command"])
        if key in plan:
            raise ValueError(f"claims_plan.csv line {n}: a second plan for {key[0]} {key[1][:40]!r}")
        if p["redecide"] and p["status"] != "planned":
            raise ValueError(f"claims_plan.csv line {n}: a row to re-decide on fresh seeds needs a planned run")
        if p["status"] not in ("planned", "measured"):
            raise ValueError(f"claims_plan.csv line {n}: status {p['status']!r}: expected planned or measured")
        if p["test"] != "describe":
            parse_compare(p["test"])
            if not p["effect"].strip():
                raise ValueError(f"claims_plan.csv line {n}: a test needs its effect or margin")
        plan_seeds(p)
        plan[key] = p
    return plan


def plan_seeds(p: dict) -> tuple[int, int]:
    """The planned seeds per arm of a plan line: `n` or `n_i,n_j`."""
    a, _, b = p["seeds"].partition(",")
    return int(a), int(b or a)


def plan_flags(row: dict, p: dict | None, figs: list[tuple[float, float, int]]) -> list[str]:
    """How a claims row departs from its plan line (empty when it follows it)."""
    if p is None:
        return ["no plan line in benchmarks/claims_plan.csv"]
    if p["test"] == "describe":
        return []
    if row["compare"].strip() != p["test"]:
        return [f"compares {row['compare'] or 'nothing'}, the plan {p['test']}"]
    if "~" in p["test"] and row["margin"].strip() != p["effect"].strip():
        return [f"margin {row['margin']}, the plan {p['effect']}"]
    if p["status"] == "measured" and plan_is_paired(p) != (parse_kind(row["kind"])[0] == "paired"):
        return ["unpaired, the plan paired" if plan_is_paired(p) else "paired, the plan unpaired"]
    i, _, j = parse_compare(p["test"])
    ns, planned = (figs[i][2], figs[j][2]), plan_seeds(p)
    beyond = ns[0] > planned[0] or ns[1] > planned[1]
    if beyond or (p["status"] == "measured" and ns != planned):
        return [f"{fmt_ns(ns)} seeds per arm, the plan {fmt_ns(planned)}"]
    return []


def plan_afford(p: dict) -> int:
    """The most seeds per arm a plan line can afford: MAX_SEEDS, or the seeds that ROW_CORE_HOURS of one core buy at
    the `seed_s=` of its pilot, the seconds a seed of both arms took in the row's earlier run, if that is more."""
    parts = dict(part.strip().split("=", 1) for part in p["pilot"].split(";") if "=" in part)
    if "seed_s" not in parts:
        return MAX_SEEDS
    return max(MAX_SEEDS, int(3600 * ROW_CORE_HOURS // float(parts["seed_s"])))


def plan_is_paired(p: dict) -> bool:
    """A paired plan records its pilot's per-seed differences as `sd_d=` (an unpaired one each arm's `sd=`)."""
    return "sd_d=" in p["pilot"]


def fmt_ns(ns: tuple[int, int]) -> str:
    return str(ns[0]) if ns[0] == ns[1] else f"{ns[0]} / {ns[1]}"


# ---- the verdicts of the claims table ----
class Judgement(NamedTuple):
    verdict: str  # yes, no, inconclusive, underpowered or descriptive
    decision: Decision | None  # the row's interval (None for a row that compares no two figures)
    q: float  # Benjamini-Hochberg adjusted p-value (nan outside the directional rows)
    power: float  # power of the planned seeds at the observed spread (nan where no plan applies)
    needed: int | None  # seeds per arm that 80% power needs at the observed spread (None: more than 100,000 or n/a)
    flags: tuple[str, ...]  # how the row departs from its plan
    plan: dict | None
    effect: float = math.nan  # the plan's effect or margin in the figures' units
    p_short: float = math.nan  # p-value against δ where the difference falls short of it (`shortfall_p`; nan on '~',
    q_short: float = math.nan  # descriptive and unplanned rows) and its Benjamini-Hochberg adjustment


def _row_power(row: dict, p: dict, figs: list, paired: tuple | None = None) -> tuple[float, int | None, float]:
    """(power of the planned seeds, seeds per arm for 80%, the effect) at the figures' observed means and spread (the
    spread of the per-seed differences on a paired row)."""
    i, op, j = parse_compare(p["test"])
    effect = parse_margin(p["effect"], figs[i][0], figs[j][0])
    kind_name, (se_i, se_j) = parse_kind(row["kind"])
    if kind_name == "exact":
        se = math.hypot(*(0.0 if k is None else figs[k][0] for k in (se_i, se_j)))
        return exact_power(op, effect, se), None, effect
    sds = (paired[1],) if paired else (figs[i][1], figs[j][1])
    return power(op, effect, sds, plan_seeds(p)), seeds_needed(op, effect, sds), effect


def judge(rows: list[dict], plan: dict) -> list[Judgement]:
    """The verdict of every claims row under its plan, with the Benjamini-Hochberg step across the directional rows."""
    pre = []
    for row in rows:
        p = plan.get(claim_key(row))
        figs, paired = row_stats(row)
        d = decide(row["compare"], row["kind"], row["margin"], figs, paired) if row["compare"] else None
        pre.append((row, p, figs, d, paired))
    family = [k for k, (row, p, _, d, _) in enumerate(pre) if d is not None and not math.isnan(d.p)
              and (p is None or p["test"] != "describe")]
    qs = dict(zip(family, bh_adjust([pre[k][3].p for k in family])))
    shorts = {}  # the same rows tested against their plan's δ instead of 0 (a row without a plan has no δ)
    for k in family:
        _, p, figs, d, _ = pre[k]
        i, op, j = parse_compare(p["test"]) if p is not None else (0, "~", 0)
        if op != "~" and not math.isnan(d.se):
            shorts[k] = shortfall_p(d, op, parse_margin(p["effect"], figs[i][0], figs[j][0]))
    q_shorts = dict(zip(shorts, bh_adjust(list(shorts.values()))))
    return [_verdict(*pre[k], qs.get(k, math.nan), shorts.get(k, math.nan), q_shorts.get(k, math.nan))
            for k in range(len(pre))]


def _verdict(row: dict, p: dict | None, figs: list, d: Decision | None, paired: tuple | None, q: float,
             p_short: float, q_short: float) -> Judgement:
    flags = tuple(plan_flags(row, p, figs))
    if p is not None and p["test"] == "describe":
        return Judgement("descriptive", d, math.nan, math.nan, None, flags, p)
    if p is None or d is None:
        return Judgement("inconclusive", d, q, math.nan, None, flags, p)
    pw, needed, effect = _row_power(row, p, figs, paired)
    i, op, j = parse_compare(p["test"])
    few = parse_kind(row["kind"])[0] != "exact" and min(figs[i][2], figs[j][2]) < MIN_SEEDS
    verdict = None
    if not (flags or few or p["redecide"]):
        if op == "~":
            verdict = d.verdict if d.verdict in ("yes", "no") else None
        elif q <= FDR and (d.diff < 0) == (op == "<"):
            verdict = "yes"
        elif q <= FDR or q_short <= FDR:  # it points the other way, or it falls short of the effect δ
            verdict = "no"
    if verdict is None:
        verdict = "underpowered" if pw < POWER else "inconclusive"
    return Judgement(verdict, d, q, pw, needed, flags, p, effect, p_short, q_short)


def claims_judgements(rows: list[dict] | None = None, plan: dict | None = None) -> list[Judgement]:
    rows = read_claims() if rows is None else rows
    return judge(rows, read_plan() if plan is None else plan)


def row_verdict(row: dict) -> str:
    """The verdict of one row of claims.csv (judged with all the others: the multiplicity step spans the table)."""
    rows = read_claims()
    return next(jd.verdict for r, jd in zip(rows, claims_judgements(rows)) if r == row)


# ---- the claims table ----
def read_claims() -> list[dict]:
    with open(RESULTS / "claims.csv", newline="") as f:
        return list(csv.DictReader(f))


def fmt_plan(row: dict, jd: Judgement) -> str:
    """The plan column: the effect or margin, the seeds and their power, and any departure from the plan."""
    p = jd.plan
    if p is None:
        return "**no plan**" + "".join(f"; {flag}" for flag in jd.flags[1:])
    if jd.verdict == "descriptive":
        return f"descriptive: {p['note']}" if p["note"] else "descriptive"
    what = f"margin ± {p['effect']}" if "~" in p["test"] else f"δ = {p['effect']}"
    if p["effect"].endswith("%") and not math.isnan(jd.effect):
        what += f" ({jd.effect:.{row_digits(row)}f})"
    seeds = fmt_ns(plan_seeds(p))
    if math.isnan(jd.power):
        text = what
    elif parse_kind(row["kind"])[0] == "exact":
        text = f"{what}; exact figures, power {jd.power:.2f}"
    elif p["status"] == "planned":
        text = f"{what}; planned: {seeds} fresh seeds per arm, power {jd.power:.2f} at this spread"
    else:
        text = f"{what}; {seeds} seeds per arm, power {jd.power:.2f}"
    if jd.verdict == "underpowered":
        text += f"; 80% needs {jd.needed} per arm" if jd.needed else "; 80% needs over 100,000 per arm"
    if p["redecide"]:
        text += f"; to re-decide on fresh seeds ({p['redecide']})"
    return text + "".join(f"; **departs from its plan**: {flag}" for flag in jd.flags)


def row_digits(row: dict) -> int:
    """The digits of a row's first compared figure (2 for a row that compares none)."""
    return parse_figures(row["figures"])[parse_compare(row["compare"])[0]][1] if row["compare"] else 2


def fmt_pq(jd: Judgement) -> str:
    """`p 0.015, q 0.042` (p alone outside the multiplicity step; none on descriptive rows, which test nothing), and
    `; short of δ: p 0.003, q 0.011` where the difference falls short of the plan's δ."""
    if jd.decision is None or math.isnan(jd.decision.p) or jd.verdict == "descriptive":
        return "-"
    f = lambda x: "0" if x == 0 else f"{x:.2g}" if x >= 1e-3 else f"{x:.0e}"  # noqa: E731
    text = f"p {f(jd.decision.p)}, q {f(jd.q)}" if not math.isnan(jd.q) else f"p {f(jd.decision.p)}"
    if jd.p_short < 1:
        text += f"; short of δ: p {f(jd.p_short)}, q {f(jd.q_short)}"
    return text


def says_no_by_shortfall_only(jd: Judgement) -> bool:
    """A no whose difference does not point the other way at q ≤ 0.05: it falls short of the plan's δ."""
    return jd.verdict == "no" and jd.q_short <= FDR and not jd.q <= FDR


def verdict_counts(verdicts: list[str]) -> dict[str, int]:
    return {v: verdicts.count(v) for v in DIRECTIONS}


def claims_table() -> str:
    rows = read_claims()
    jds = claims_judgements(rows)
    family = sum(not math.isnan(jd.q) for jd in jds)
    c = verdict_counts([jd.verdict for jd in jds])
    lines = [RULE.format(min_seeds=MIN_SEEDS, max_seeds=MAX_SEEDS, family=family, core_hours=ROW_CORE_HOURS,
                         cheap_s=int(3600 * ROW_CORE_HOURS // MAX_SEEDS), no=c["no"],
                         short_family=sum(not math.isnan(jd.q_short) for jd in jds),
                         short_no=sum(says_no_by_shortfall_only(jd) for jd in jds)),
             "| paper | claim | the paper's figure | ours | difference (95% interval) | p, BH q | plan | "
             "direction holds | command |", "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    for r, jd in zip(rows, jds):
        diff = "-" if jd.decision is None else f"{fmt_decision(jd.decision, row_digits(r))} ({r['kind'].split()[0]})"
        lines.append(f"| {cell(r['paper'])} | {cell(r['claim'])} | {cell(r['paper_figure'])} | {cell(r['ours'])} | "
                     f"{cell(diff)} | {fmt_pq(jd)} | {cell(fmt_plan(r, jd))} | **{jd.verdict}** | "
                     f"`{r['command']}` |")
    judged = len(rows) - c["descriptive"]
    planned = [jd.plan for jd in jds if jd.plan and jd.plan["status"] == "planned" and jd.verdict != "descriptive"]
    departs = sum(bool(jd.flags) for jd in jds)
    lines += ["", f"{len(rows)} claims: {judged} judged ({c['yes']} yes, {c['no']} no, {c['inconclusive']} "
              f"inconclusive, {c['underpowered']} underpowered) and {c['descriptive']} descriptive rows outside the "
              f"count. {len(planned)} {'row has' if len(planned) == 1 else 'rows have'} a fresh run planned "
              f"({sum(bool(p['redecide']) for p in planned)} of them can be decided by that run only); {departs} "
              f"{'row departs from its plan' if departs == 1 else 'rows depart from their plans'}. Rows: "
              "`benchmarks/results/claims.csv` (its `figures` column names the results rows each figure is computed "
              "from, `compare`, `kind` and `margin` give the rule its inputs); plans: "
              "`benchmarks/claims_plan.csv` (metric, test, effect or margin with its justification, seeds per arm "
              "with the pilot's effect, spreads and seeds they were estimated from, status); tests/test_report.py "
              "recomputes every figure and verdict."]
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
      "grpo_family.csv#algos/grpo.py#GRPO (seq-mean)#eval_acc_end#100#seeds=0-9@1",
      "grpo_family.csv#algos/dapo.py#DAPO#eval_acc_end#100#seeds=0-9@1",
      "grpo_family.csv#algos/gspo.py#GSPO#eval_acc_end#100#seeds=0-9@1",
      "grpo_family.csv#algos/rloo.py#RLOO#eval_acc_end#100#seeds=0-9@1",
      "grpo_family.csv#algos/ppo.py#PPO#eval_acc_end#100#seeds=0-9@1"]),
    ("On-policy distillation", "on-policy-distillation",
     "dense bridge from an RL'd teacher {0} vs GRPO on the student {1}; reverse KL on 8-step-stale rollouts {2} "
     "vs forward KL {3}; all-token self-distillation {4}",
     ["opd_bridge.csv#algos/opd.py#grpo-teacher+bridge#eval_acc_end#100#seeds=0-9@1",
      "opd_bridge.csv#algos/grpo.py#grpo-student#eval_acc_end#100#seeds=0-9@1",
      "async_opd.csv#algos/async_opd.py#rkl-stale|k=8#eval_acc_end#100#seeds=0-2@1",
      "async_opd.csv#algos/async_opd.py#fkl|k=8#eval_acc_end#100#seeds=0-2@1",
      "self_opd.csv#algos/self_opd.py#opsd#eval_acc_end#100#seeds=0-9@1"]),
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
     "pessimism {4}; HABC with interventions on a gridworld: success {5} -> {6}, steps to the goal {7} vs {8} "
     "with the success critic alone",
     ["offline_rl.csv#iql#halfcheetah-medium-replay#behaviour_score#1@1",
      "offline_rl.csv#iql#halfcheetah-medium-replay#score_last#1@1",
      "offline_rl.csv#td3_bc#halfcheetah-medium-replay#score_last#1#bench=corl_plan@1",
      "offline_rl.csv#ravl#learned/ravl#score_last#1#bench=ravl_plan@1",
      "offline_rl.csv#ravl#learned/none#score_last#1#bench=ravl_plan@1",
      "habc.csv#algos/habc.py#HABC#success_first#100#seeds=0-4@1",
      "habc.csv#algos/habc.py#HABC#success_last#100#seeds=0-4@1",
      "habc.csv#algos/habc.py#HABC#steps_last#1#seeds=0-4@1", "habc.csv#algos/habc.py#AWBC#steps_last#1#seeds=0-4@1"]),
    ("World models", "world-models",
     "pixel MSE at 4x the training horizon: LIVE {0}, same denoiser without the cycle loss {1}, teacher-forced "
     "predictor {2}; policy ranking in the learned model: Pearson {3} over seven eps-greedy policies, {4} with six "
     "that differ in kind added; verifier-gated chunks (FFDC) need {5} model calls per episode vs {6} with 2-step "
     "chunks when the world is perturbed at 10% of steps; ReGuide-FT success {7} -> {8} vs {9} absorbing as many "
     "unguided successes",
     ["world_models.csv#live#{\"mode\": \"live\"}#err_h32#1@4", "world_models.csv#diffusion#{}#err_h32#1#seeds=0-5@4",
      "world_models.csv#ar#{}#err_h32#1@4",
      "world_models.csv#policy-eval#{}#pearson#1#seeds=0-9@2",
      "world_models.csv#policy-eval-kinds#{\"policies\": [\"0\", \"0.1\", \"0.2\", \"0.35\", \"0.5\", \"0.7\", "
      "\"1\", \"detour=6\", \"detour=9\", \"near=2\", \"near=4\", \"stall=0.5\", \"stall=0.7\"]}#pearson#1@2",
      "ffdc.csv#ffdc#{}#gated_r0.1_calls#1#seeds=0-9@2", "ffdc.csv#ffdc#{}#short_r0.1_calls#1#seeds=0-9@2",
      "reguide.csv#worldmodels/reguide.py#ReGuide-FT#success_base#100@1",
      "reguide.csv#worldmodels/reguide.py#ReGuide-FT#success_reguide#100@1",
      "reguide.csv#worldmodels/reguide.py#ReGuide-FT#success_control#100@1"]),
]


# groups of the claims table; a group joins HEADLINE once its benchmark has figures worth a headline line
GROUPS = [g for g, *_ in HEADLINE] + ["Tree rollouts", "Partial and asynchronous rollouts", "FP8 rollouts",
                                      "Multi-turn agents", "MoE routing replay"]


def headline_table() -> str:
    claims = read_claims()
    verdicts = [jd.verdict for jd in claims_judgements(claims)]
    c = verdict_counts(verdicts)
    total = " / ".join(str(c[v]) for v in VERDICTS)
    lines = ["| group | headline figures (mean ± std over seeds) | paper claims: yes / no / inconclusive / "
             f"underpowered (all {len(claims) - c['descriptive']} judged claims: {total}; "
             f"{c['descriptive']} descriptive) |",
             "|---|---|---|"]
    for group, anchor, template, refs in HEADLINE:
        figs = []
        seeds = set()
        for ref, digits in parse_figures(";".join(refs)):
            m, sd, n = figure(ref)
            figs.append(fmt(m, sd, n, digits))
            seeds.add(n)
        seed_txt = ", ".join(f"{n} seeds" if n > 1 else "1 run" for n in sorted(seeds, reverse=True))
        mine = [v for r, v in zip(claims, verdicts) if r["group"] == group and v != "descriptive"]
        counts = " / ".join(str(mine.count(v)) for v in VERDICTS) if mine else "-"
        lines.append(f"| [{group}](benchmarks/README.md#{anchor}) | {template.format(*figs)} ({seed_txt}) | "
                     f"{counts} |")
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
            body = re.sub(r"\A# .*\n+", "", body)  # a standalone page's title: the section's heading stands for it
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
    rows = read_claims()
    for r, jd in zip(rows, claims_judgements(rows)):
        if r["direction"] != jd.verdict:
            print(f"claims.csv: {r['paper'][:50]} | {r['claim'][:50]}: direction {r['direction']}, the rule gives "
                  f"{jd.verdict}" + "".join(f"; {flag}" for flag in jd.flags), file=sys.stderr)
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python benchmarks/report.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
