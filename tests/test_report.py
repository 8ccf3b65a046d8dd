"""The claims table (benchmarks/results/claims.csv) and its plan (benchmarks/claims_plan.csv).

For each row: all columns are filled, the paper is named by title and arXiv id, the command runs an existing script,
every figure named in `figures` is recomputed from its results CSV and found, formatted, in `ours` together with its
number of seeds, the row has a plan line, and its `direction` is the verdict benchmarks/report.py gives: the plan's
test, Welch's p-value with the Benjamini-Hochberg step across the directional rows, the equivalence interval for '~'
rows, `underpowered` when the planned seeds cannot reach 80% power at the observed spread, `descriptive` outside the
count. Tests below pin the rule on planted data: each asserts a verdict the rule would change if it lost a step.
"""
import csv
import math
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

ROWS = report.read_claims()
PLAN = report.read_plan()
JUDGED = dict(zip(map(report.claim_key, ROWS), report.judge(ROWS, PLAN)))


def test_claims_csv_has_the_columns():
    with open(report.RESULTS / "claims.csv", newline="") as f:
        assert next(csv.reader(f)) == report.CLAIM_FIELDS
    with open(report.PLAN, newline="") as f:
        assert next(csv.reader(f)) == report.PLAN_FIELDS
    assert len(ROWS) >= 10


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['paper'][:30]}|{r['claim'][:30]}")
def test_claim_row(row):
    for col in report.CLAIM_FIELDS:
        if col not in ("compare", "margin"):
            assert row[col] and row[col].strip(), f"empty column {col}"
    assert row["direction"] in report.DIRECTIONS
    assert re.search(r'"[^"]+", arXiv:\d{4}\.\d{4,5}$', row["paper"]), "paper: give its title in quotes and arXiv id"
    assert row["group"] in report.GROUPS, f"unknown group {row['group']!r}"
    cmd = row["command"].split()
    assert cmd[0] == "python" and (ROOT / cmd[1]).is_file(), f"command runs no script of the repository: {cmd}"

    figs = []
    for ref, digits in report.parse_figures(row["figures"]):
        mean, sd, n = report.figure(ref)
        figs.append((mean, sd, n))
        text = report.fmt(mean, sd, n, digits)
        assert text in row["ours"], f"{ref}: {text} is not in ours: {row['ours']!r}"
        seeds = f"{n} seed" + ("s" if n > 1 else "")
        assert seeds in row["ours"] or (n == 1 and "1 run" in row["ours"]), f"{ref}: ours does not say '{seeds}'"
    assert figs, "no figures"
    report.parse_kind(row["kind"])  # seeded, exact or exact se=k,l
    assert bool(row["margin"].strip()) == ("~" in row["compare"]), "a '~' row, and only one, has a margin"
    assert report.claim_key(row) in PLAN, "no line for this row in benchmarks/claims_plan.csv"
    assert row["direction"] == JUDGED[report.claim_key(row)].verdict


def test_every_plan_line_has_a_row_and_reads_as_a_plan():
    keys = set(map(report.claim_key, ROWS))
    for key, p in PLAN.items():
        assert key in keys, f"plan line without a claims row: {key[0]} {key[1][:50]!r}"
        assert p["metric"].strip() and p["justification"].strip(), f"{key[0]}: metric and justification are required"
        if p["test"] == "describe":
            assert p["note"].strip(), f"{key[0]}: a descriptive row says why in its note"
            continue
        effect = report.parse_margin(p["effect"], 1.0, 1.0)
        assert effect > 0, f"{key[0]}: the effect or margin must be positive"
        assert p["status"] == "planned" or not p["redecide"]


@pytest.mark.parametrize("key", [k for k, p in PLAN.items() if p["pilot"]], ids=lambda k: f"{k[0]}|{k[1][:30]}")
def test_plan_seeds_follow_their_power_estimate(key):
    """The recorded seeds_needed is the power estimate of its recorded inputs, and the planned seeds are it wherever
    a row can afford it (rows that already had enough seeds keep theirs; rows that cannot afford it keep theirs, or
    plan a fresh run of all a row can afford, and are underpowered unless that run decides them); a planned run once
    done (its note names the fresh run) keeps the seeds it was planned with."""
    p = PLAN[key]
    inputs = dict(part.strip().split("=") for part in p["pilot"].split(";"))
    # a paired plan records the spread of the pilot's per-seed differences, sd_d, and its seeds once
    paired = report.plan_is_paired(p)
    sds = (float(inputs["sd_d"]),) if paired else tuple(float(x) for x in inputs["sd"].split(","))
    measured = tuple(int(x) for x in inputs["n"].split(",")) * (2 if paired else 1)
    op = report.parse_compare(p["test"])[1]
    needed = report.seeds_needed(op, float(inputs["delta"]), sds)
    assert p["seeds_needed"] == (str(needed) if needed else ">100000")
    seeds = report.plan_seeds(p)
    affordable = min(needed or 10**9, report.plan_afford(p))  # the seeds 80% power needs, or all a row can afford
    if p["redecide"]:
        assert p["status"] == "planned" and seeds == (affordable, affordable)
    elif p["status"] == "measured" and "fresh run" in p["note"]:  # a planned run done: its seeds, as planned
        assert seeds == (affordable, affordable)
    elif p["status"] == "planned":  # a fresh run of what 80% power needs; the pilot is enough only where it may
        # also be the test, which it may not where it chose the metric
        assert min(measured) < affordable or "the pilot chose this metric" in p["note"]
        assert seeds == (affordable, affordable)
    elif needed is not None and needed <= min(measured):
        assert seeds == measured
    else:  # unaffordable, or seeds added after a verdict: the plan keeps the seeds fixed before the runs
        assert needed is None or needed > report.plan_afford(p) or "after" in p["note"]


def test_rule_text_describes_the_plan_multiplicity_and_verdicts():
    text = report.claims_table().split("\n| paper |")[0]
    for words in ("claims_plan.csv", "80% power", "Benjamini-Hochberg", "**underpowered**", "**Descriptive**",
                  "fresh seeds", "never from our own results", "counted work", "*paired*", "per-seed differences",
                  "short of δ", "after most of the plans' runs"):
        assert words in text, f"the rule text does not mention {words!r}"
    counts = report.verdict_counts([jd.verdict for jd in JUDGED.values()])
    assert f"{counts['yes']} yes, {counts['no']} no, {counts['inconclusive']} inconclusive, " \
           f"{counts['underpowered']} underpowered" in report.claims_table()


# ---- the rule on planted data ----
HEAD = "bench,script,config,seed,metric,value,command,commit,hardware,versions,timestamp\n"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """planted({config: [per-seed values]}) writes them to a results CSV that `t.csv#s#<config>#m#1` reads."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)

    def write(arms: dict[str, list[float]]) -> None:
        lines = [f"b,s,{cfg},{k},m,{v},,,,," for cfg, vals in arms.items() for k, v in enumerate(vals)]
        (tmp_path / "t.csv").write_text(HEAD + "\n".join(lines) + "\n")
    return write


def claim(a: str, b: str, compare: str = "0>1", margin: str = "", name: str = "c") -> dict:
    return {"group": "g", "paper": '"P", arXiv:0000.00001', "claim": name, "paper_figure": "-", "ours": "-",
            "direction": "-", "command": "python x.py", "figures": f"t.csv#s#{a}#m#1@2; t.csv#s#{b}#m#1@2",
            "compare": compare, "kind": "seeded", "margin": margin}


def plan_line(row: dict, effect: str, seeds: str = "5", status: str = "measured", redecide: str = "",
              test: str | None = None) -> dict:
    pilot = "sd_d=1" if row.get("kind") == "paired" else ""  # a paired plan records its pilot's per-seed spread
    return {"arxiv": "0000.00001", "claim": row["claim"], "command": row["command"], "metric": "m",
            "test": test or row["compare"], "effect": effect, "justification": "planted", "seeds": seeds,
            "pilot": pilot, "seeds_needed": "", "status": status, "redecide": redecide, "note": ""}


def judge(*rows_and_plans: tuple[dict, dict]) -> list[report.Judgement]:
    rows = [r for r, _ in rows_and_plans]
    return report.judge(rows, {report.claim_key(r): p for r, p in rows_and_plans})


A_UP = [2.0, 2.6, 3.1, 3.5, 2.2]  # mean 2.68
B_LOW = [1.0, 1.9, 1.4, 2.3, 1.2]  # mean 1.56: Welch p = 0.016 against A_UP
NULLS = [[5.0, 5.4, 4.6, 5.2, 4.8], [5.1, 4.9, 5.3, 4.7, 5.0], [7.0, 7.3, 6.8, 7.1, 6.9], [7.2, 6.8, 7.0, 7.1, 6.9]]


def test_a_clear_effect_is_yes_and_its_reverse_no(planted):
    planted({"hi": [10.0, 10.5, 9.5, 10.2, 9.8], "lo": [5.0, 5.4, 4.6, 5.2, 4.8]})
    row = claim("hi", "lo")
    (jd,) = judge((row, plan_line(row, "2.0")))
    assert jd.verdict == "yes" and jd.decision.p < 1e-4 and jd.power > 0.99 and not jd.flags
    rev = claim("hi", "lo", compare="0<1")
    assert judge((rev, plan_line(rev, "2.0")))[0].verdict == "no"


def test_no_effect_is_no_when_powered_and_underpowered_when_not(planted):
    planted({"a": NULLS[0], "b": NULLS[1]})
    row = claim("a", "b")
    (jd,) = judge((row, plan_line(row, "2.0")))  # a 2-point effect stands out of a 0.3 spread: powered, and ruled out
    assert jd.verdict == "no" and jd.power >= 0.8 and jd.decision.p > 0.5 and jd.q > report.FDR
    assert jd.decision.hi < 2.0 and jd.p_short < 1e-4 and report.says_no_by_shortfall_only(jd)
    assert "short of δ: p" in report.fmt_pq(jd)
    (jd,) = judge((row, plan_line(row, "0.1")))  # a 0.1 effect is not: underpowered, with the seeds it needs
    assert jd.verdict == "underpowered" and jd.power < 0.8 and jd.decision.hi > 0.1 and jd.q_short > report.FDR
    assert jd.needed == report.seeds_needed(">", 0.1, (statistics.stdev(NULLS[0]), statistics.stdev(NULLS[1])))
    assert jd.needed > 5 and "80% needs" in report.fmt_plan(row, jd)


HALF_UP = [5.5, 6.1, 5.0, 5.8, 5.1]  # mean 5.5: 0.5 above HALF_LOW, Welch interval [-0.10, +1.10], p 0.091
HALF_LOW = [5.0, 4.6, 5.5, 4.8, 5.1]


def test_shortfall_p_is_the_test_against_delta_on_the_short_side_only():
    d = report.decide("0>1", "seeded", "", [(5.5, 0.4637, 5), (5.0, 0.3391, 5)])
    assert report.shortfall_p(d, ">", 0.5) == 1.0 and report.shortfall_p(d, ">", 0.2) == 1.0  # it reaches δ
    lo, hi = report.t_interval(d.diff, d.se, d.dof)
    assert report.shortfall_p(d, ">", hi) == pytest.approx(0.05)  # δ at the interval's edge: p is the level
    assert report.shortfall_p(d, ">", hi + 0.01) < 0.05 < report.shortfall_p(d, ">", hi - 0.01)
    rev = report.decide("0<1", "seeded", "", [(5.0, 0.3391, 5), (5.5, 0.4637, 5)])  # '<': the paper's way is down
    assert report.shortfall_p(rev, "<", 0.5) == 1.0 and report.shortfall_p(rev, "<", 1.3) < 0.05


def test_a_powered_row_that_neither_sees_nor_rules_out_delta_is_inconclusive(planted):
    planted({"up": HALF_UP, "low": HALF_LOW})
    row = claim("up", "low")
    (jd,) = judge((row, plan_line(row, "1.0")))  # the interval holds both 0 and δ = 1
    assert jd.verdict == "inconclusive" and jd.power >= 0.8 and jd.decision.lo < 0 < 1.0 < jd.decision.hi


def test_a_yes_short_of_delta_stays_yes(planted):
    planted({"hi": [10.0, 10.5, 9.5, 10.2, 9.8], "lo": [5.0, 5.4, 4.6, 5.2, 4.8]})
    row = claim("hi", "lo")
    (jd,) = judge((row, plan_line(row, "20")))  # 5 points up, sure of it, and sure that it is not 20
    assert jd.verdict == "yes" and jd.q_short < 1e-4 and not report.says_no_by_shortfall_only(jd)


def test_benjamini_hochberg_holds_back_a_marginal_shortfall(planted):
    """Alone, a 0.5 lead whose interval stops short of δ = 1.25 (p 0.02 against δ) says no; beside four rows that reach
    their δ (p 1 against it), its q against δ is five times its p, and it says nothing."""
    planted({"up": HALF_UP, "low": HALF_LOW, "hi": [10.0, 10.5, 9.5, 10.2, 9.8], "lo": [5.0, 5.4, 4.6, 5.2, 4.8]})
    marginal = claim("up", "low", name="marginal")
    (alone,) = judge((marginal, plan_line(marginal, "1.25")))
    assert 0.01 < alone.p_short < 0.03 and alone.q_short == alone.p_short and alone.verdict == "no"
    clear = [claim("hi", "lo", name=f"clear{k}") for k in range(4)]
    judged = judge((marginal, plan_line(marginal, "1.25")), *[(r, plan_line(r, "2.0")) for r in clear])
    assert all(jd.verdict == "yes" and jd.p_short == 1.0 for jd in judged[1:])
    assert judged[0].q_short == pytest.approx(5 * alone.p_short) and judged[0].verdict == "inconclusive"


def test_equivalence_inside_and_outside_its_margin(planted):
    planted({"a": [5.0, 5.1, 4.9, 5.05, 4.95], "b": [5.02, 5.12, 4.92, 5.07, 4.97], "far": [9.0, 9.1, 8.9, 9.05, 8.95]})
    same, far = claim("a", "b", "0~1", "0.5", "same"), claim("a", "far", "0~1", "0.5", "far")
    j_same, j_far = judge((same, plan_line(same, "0.5")), (far, plan_line(far, "0.5")))
    assert j_same.verdict == "yes" and j_far.verdict == "no"
    assert math.isnan(j_same.q), "'~' rows stay out of the multiplicity step"
    # the same figures to be re-decided on fresh seeds (a margin set after the run) cannot say yes
    (jd,) = judge((same, plan_line(same, "0.5", status="planned", redecide="margin set after the run")))
    assert jd.verdict == "inconclusive"


def test_benjamini_hochberg_flips_a_marginal_row(planted):
    planted({"up": A_UP, "low": B_LOW, **{f"n{k}": v for k, v in enumerate(NULLS)}})
    marginal = claim("up", "low", name="marginal")
    (alone,) = judge((marginal, plan_line(marginal, "1.5")))  # δ = 1.5 lies inside its interval [0.27, 1.97]
    assert 0.01 < alone.decision.p < 0.02 and alone.q == alone.decision.p and alone.verdict == "yes"
    nulls = [claim(f"n{2 * k}", f"n{2 * k + 1}", name=f"null{k}") for k in range(2)]
    nulls += [claim(f"n{2 * k + 1}", f"n{2 * k}", name=f"null{k}r") for k in range(2)]
    judged = judge((marginal, plan_line(marginal, "1.5")), *[(r, plan_line(r, "1.5")) for r in nulls])
    assert judged[0].q == pytest.approx(5 * alone.decision.p) and judged[0].q > report.FDR
    assert judged[0].verdict == "inconclusive"


SHARED = [3.0, 7.0, 5.0, 9.0, 4.0]  # what a seed gives both arms (its initial policy, data, evaluation set)


def test_a_paired_row_tests_the_per_seed_differences(planted):
    """Arms that ran the same seeds share most of their spread: Welch's test cannot see a 0.5 lead under a seed-to-seed
    spread of 2.4, the paired test on the differences (spread 0.1) does, and matches scipy's paired t test."""
    from scipy import stats

    lead = [0.45, 0.6, 0.5, 0.4, 0.55]
    planted({"a": [s + d for s, d in zip(SHARED, lead)], "b": SHARED, "short": SHARED[:4]})
    row = claim("a", "b")
    (welch,) = judge((row, plan_line(row, "0.5")))
    assert welch.verdict == "underpowered" and welch.decision.p > 0.5
    row["kind"] = "paired"
    (jd,) = judge((row, plan_line(row, "0.5")))
    res = stats.ttest_rel([s + d for s, d in zip(SHARED, lead)], SHARED)
    assert jd.verdict == "yes" and abs(jd.decision.p - res.pvalue) < 1e-12 and jd.power > 0.99
    ci = res.confidence_interval(0.95)
    assert abs(jd.decision.lo - ci.low) < 1e-9 and abs(jd.decision.hi - ci.high) < 1e-9
    assert jd.needed == report.seeds_needed(">", 0.5, (statistics.stdev(lead),)) == report.MIN_SEEDS
    row["compare"] = "0<1"
    assert judge((row, plan_line(row, "0.5")))[0].verdict == "no"
    # the plan, not the figures, says whether the arms are paired: a paired row under an unpaired plan (or the
    # reverse) departs from it and cannot be decided
    row["compare"] = "0>1"
    (jd,) = judge((row, plan_line(row, "0.5") | {"pilot": "delta=0.5; sd=1,1; n=3,3"}))
    assert jd.flags == ("paired, the plan unpaired",) and jd.verdict == "inconclusive"
    (jd,) = judge((claim("a", "b"), plan_line(row, "0.5") | {"pilot": "delta=0.5; sd_d=0.1; n=5"}))
    assert jd.flags == ("unpaired, the plan paired",)
    with pytest.raises(ValueError, match="same seeds"):  # seed 4 has no partner
        report.row_stats(claim("a", "short") | {"kind": "paired"})


def test_paired_power_matches_a_simulation():
    """`power` with one spread is the rejection rate of the two-sided paired t test: 4000 simulated rows of 6 seeds."""
    np = pytest.importorskip("numpy")
    from scipy import stats

    rng = np.random.default_rng(1)
    d = rng.normal(0.5, 0.7, (4000, 6))
    rate = (stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean()
    assert abs(rate - report.power(">", 0.5, (0.7,), (6, 6))) < 0.03  # binomial s.e. 0.008


def test_bh_adjust_by_hand():
    qs = report.bh_adjust([0.01, 0.04, 0.03, 0.5])
    assert qs == pytest.approx([0.04, 0.04 * 4 / 3, 0.04 * 4 / 3, 0.5])  # step-up: q_(2) = min(0.03*4/2, 0.04*4/3)


def test_a_plan_deviation_is_flagged_and_holds_the_verdict(planted):
    planted({"hi": [10.0, 10.5, 9.5, 10.2, 9.8], "lo": [5.0, 5.4, 4.6, 5.2, 4.8]})
    row = claim("hi", "lo")
    (jd,) = judge((row, plan_line(row, "2.0", seeds="3")))  # 5 seeds measured where the plan fixed 3
    assert jd.flags == ("5 seeds per arm, the plan 3",) and jd.verdict == "inconclusive" and jd.power > 0.8
    assert "**departs from its plan**" in report.fmt_plan(row, jd)
    assert judge((row, plan_line(row, "2.0", seeds="5")))[0].verdict == "yes"  # the same figures under their plan
    (jd,) = judge((row, plan_line(row, "2.0", test="0<1")))  # the row tests another direction than its plan
    assert jd.flags and jd.verdict == "inconclusive"
    eq = claim("hi", "lo", "0~1", "10%")
    (jd,) = judge((eq, plan_line(eq, "6.0")))  # a margin other than the plan's: neither its "no" nor the plan's "yes"
    assert jd.flags == ("margin 10%, the plan 6.0",) and jd.decision.verdict == "no" and jd.verdict == "inconclusive"
    (jd,) = judge((row, None))
    assert jd.flags and jd.verdict == "inconclusive"


def test_descriptive_rows_stay_outside_the_multiplicity_step(planted):
    """The marginal row of the test above keeps its yes beside four descriptive rows that, as directional rows, flip it."""
    planted({"up": A_UP, "low": B_LOW, **{f"n{k}": v for k, v in enumerate(NULLS)}})
    marginal = claim("up", "low", name="marginal")
    described = [claim(f"n{k}", f"n{(k + 1) % 4}", name=f"seconds{k}") for k in range(4)]
    judged = judge((marginal, plan_line(marginal, "2.0")), *[(r, plan_line(r, "", test="describe")) for r in described])
    assert all(jd.verdict == "descriptive" and math.isnan(jd.q) for jd in judged[1:])
    assert judged[0].q == judged[0].decision.p and judged[0].verdict == "yes"


def test_power_matches_a_simulation():
    """`power` is the rejection rate of the two-sided Welch test: 4000 simulated rows of 5 seeds per arm."""
    np = pytest.importorskip("numpy")
    from scipy import stats

    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 0.6, (4000, 5)), rng.normal(0.0, 0.5, (4000, 5))
    rate = (stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05).mean()
    assert abs(rate - report.power(">", 1.0, (0.6, 0.5), (5, 5))) < 0.03  # binomial s.e. 0.007
    need = report.seeds_needed(">", 1.0, (0.6, 0.5))
    assert report.power(">", 1.0, (0.6, 0.5), (need, need)) >= 0.8 > report.power(">", 1.0, (0.6, 0.5), (need - 1,) * 2)


def test_welch_interval_matches_scipy_on_raw_seeds():
    from scipy import stats

    a, b = [50.1, 47.3, 52.8, 49.0], [44.0, 46.5, 41.2]
    res = stats.ttest_ind(a, b, equal_var=False)
    ci = res.confidence_interval(0.95)
    st = lambda v: (sum(v) / len(v), stats.tstd(v), len(v))  # noqa: E731
    lo, hi = report.welch_interval(st(a), st(b))
    assert abs(lo - ci.low) < 1e-9 and abs(hi - ci.high) < 1e-9
    assert abs(report.decide("0>1", "seeded", "", [st(a), st(b)]).p - res.pvalue) < 1e-12
    lo, hi = report.welch_interval(st(a), (40.0, 0.0, 3))  # one arm without spread: t with n_a - 1 dof
    half = stats.t.ppf(0.975, len(a) - 1) * st(a)[1] / len(a) ** 0.5
    assert abs(lo - (st(a)[0] - 40.0 - half)) < 1e-9 and abs(hi - (st(a)[0] - 40.0 + half)) < 1e-9


def test_direction_rule():
    rule = lambda spec, figs: report.decide(spec, "seeded", "", figs).verdict  # noqa: E731
    assert rule("0>1", [(50.0, 2.0, 3), (40.0, 3.0, 3)]) == "yes"
    assert rule("0>1", [(40.0, 2.0, 3), (50.0, 3.0, 3)]) == "no"
    assert rule("0<1", [(40.0, 2.0, 3), (50.0, 3.0, 3)]) == "yes"
    assert rule("0<1", [(50.0, 2.0, 3), (40.0, 3.0, 3)]) == "no"
    # a gap of one std, which the old rule (noise = the larger std) called "yes", is inside Welch's interval
    assert rule("0>1", [(44.0, 2.0, 3), (40.0, 3.0, 3)]) == "inconclusive"
    # fewer than 3 seeds in an arm: inconclusive however wide the gap; one seed gives no interval at all
    assert rule("0>1", [(90.0, 1.0, 2), (10.0, 1.0, 2)]) == "inconclusive"
    assert rule("0>1", [(90.0, 1.0, 3), (10.0, 1.0, 2)]) == "inconclusive"
    assert rule("0>1", [(1.5, 0.0, 1), (1.0, 0.0, 1)]) == "inconclusive"
    assert rule("0>1", [(90.0, 1.0, 3), (10.0, 1.0, 3)]) == "yes"


def test_equivalence_needs_the_interval_inside_the_margin():
    d = report.decide
    assert d("0~1", "seeded", "2.0", [(50.0, 0.5, 5), (50.3, 0.5, 5)]).verdict == "yes"
    assert d("0~1", "seeded", "2.0", [(50.0, 0.5, 5), (58.0, 0.5, 5)]).verdict == "no"  # wholly outside
    assert d("0~1", "seeded", "2.0", [(50.0, 0.5, 5), (51.8, 0.5, 5)]).verdict == "inconclusive"  # straddles
    # a noisier measurement of the same means can only lose a "yes"
    assert d("0~1", "seeded", "2.0", [(50.0, 5.0, 5), (50.3, 5.0, 5)]).verdict == "inconclusive"
    # a percentage margin is that share of the larger |mean|
    dec = d("0~1", "seeded", "10%", [(4.0, 0.1, 4), (5.0, 0.1, 4)])
    assert abs(dec.margin - 0.5) < 1e-12 and dec.verdict == "no"
    with pytest.raises(ValueError):
        d("0~1", "seeded", "", [(1.0, 0.1, 3), (1.0, 0.1, 3)])  # '~' needs a margin
    with pytest.raises(ValueError):
        d("0>1", "seeded", "1.0", [(1.0, 0.1, 3), (1.0, 0.1, 3)])  # only '~' takes one


def test_exact_figures():
    d = report.decide
    # deterministic: the sign decides, one run is enough
    assert d("0>1", "exact", "", [(1.02, 0.0, 1), (1.0, 0.0, 1)]).verdict == "yes"
    assert d("0<1", "exact", "", [(1.02, 0.0, 1), (1.0, 0.0, 1)]).verdict == "no"
    assert d("0>1", "exact", "", [(1.0, 0.0, 1), (1.0, 0.0, 1)]).verdict == "no"  # exactly equal: no gain
    assert d("0~1", "exact", "0.05", [(1.02, 0.0, 1), (1.0, 0.0, 1)]).verdict == "yes"
    # estimates with standard errors (figures 2 and 3): normal interval on the difference
    figs = [(0.52, 0.0, 1), (0.50, 0.0, 1), (0.01, 0.0, 1), (0.01, 0.0, 1)]
    dec = d("0>1", "exact se=2,3", "", figs)
    assert abs(dec.hi - dec.lo - 2 * 1.96 * 2 ** 0.5 * 0.01) < 1e-12 and dec.verdict == "inconclusive"
    assert 0.1 < dec.p < 0.2  # z = 0.02 / (0.01 * sqrt 2) = 1.41
    figs[2] = figs[3] = (0.001, 0.0, 1)
    assert d("0>1", "exact se=2,-", "", figs).verdict == "yes"
    with pytest.raises(ValueError):
        report.parse_kind("seeded se=2,3")
    with pytest.raises(ValueError):
        report.parse_kind("paired se=2,3")


def test_sample_std_for_population_std_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    (tmp_path / "world_models.csv").write_text(HEAD + "b,s,c,0,m,1.0,,,,,\nb,s,c,1,m,3.0,,,,,\n")
    assert report.figure("world_models.csv#s#c#m#1")[1] == 1.0  # its table quotes the population std
    assert abs(report.sample_stats("world_models.csv#s#c#m#1")[1] - 2 ** 0.5) < 1e-12  # the rule uses n - 1


def test_figure_reads_the_later_of_duplicate_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rows = ["b,s,c,0,m,1.0,,,,,", "b,s,c,1,m,3.0,,,,,", "b,s,c,0,m,2.0,,,,,", "b,s,other,0,m,9.0,,,,,"]
    (tmp_path / "x.csv").write_text(HEAD + "\n".join(rows) + "\n")
    mean, sd, n = report.figure("x.csv#s#c#m#1")
    assert (mean, n) == (2.5, 2) and abs(sd - 0.7071) < 1e-3
    with pytest.raises(ValueError):
        report.figure("x.csv#s#missing#m#1")


def test_figure_filters_select_a_plans_fresh_runs(tmp_path, monkeypatch):
    """`#bench=` and `#seeds=A-B` keep the fresh runs apart from the older rows of the same CSV; an unknown filter is
    refused."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rows = ["old,s,c,0,m,1.0,,,,,", "old,s,c,1,m,3.0,,,,,", "fresh,s,c,0,m,10.0,,,,,", "fresh,s,c,5,m,20.0,,,,,",
            "fresh,s,c,6,m,30.0,,,,,"]
    (tmp_path / "x.csv").write_text(HEAD + "\n".join(rows) + "\n")
    assert sorted(report.figure_values("x.csv#s#c#m#1")) == [1.0, 3.0, 10.0, 20.0, 30.0]
    assert sorted(report.figure_values("x.csv#s#c#m#1#bench=fresh")) == [10.0, 20.0, 30.0]
    assert sorted(report.figure_values("x.csv#s#c#m#1#bench=fresh#seeds=5-6")) == [20.0, 30.0]
    assert sorted(report.figure_values("x.csv#s#c#m#2#seeds=0-1")) == [2.0, 6.0, 20.0]
    with pytest.raises(ValueError, match="unknown filter"):
        report.figure_values("x.csv#s#c#m#1#commit=abc")


def test_figure_minus_is_each_runs_change_from_another_metric(tmp_path, monkeypatch):
    """`#minus=METRIC` gives each run's metric minus its METRIC (both scaled), with the other filters applied to both;
    runs that recorded only one of the two are refused."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rows = ["b,s,c,0,late,0.5,,,,,", "b,s,c,0,early,0.75,,,,,", "b,s,c,1,late,0.9,,,,,", "b,s,c,1,early,0.5,,,,,",
            "b,s,c,7,late,1.0,,,,,"]
    (tmp_path / "x.csv").write_text(HEAD + "\n".join(rows) + "\n")
    got = report.figure_by_seed("x.csv#s#c#late#100#minus=early#seeds=0-1")
    assert got.keys() == {("b", 0), ("b", 1)} and got[("b", 0)] == pytest.approx(-25.0) \
        and got[("b", 1)] == pytest.approx(40.0)
    with pytest.raises(ValueError, match="same runs"):
        report.figure_values("x.csv#s#c#late#1#minus=early")


def test_read_plan_refuses_malformed_lines(tmp_path):
    path = tmp_path / "plan.csv"
    good = {f: "" for f in report.PLAN_FIELDS} | {"arxiv": "1", "claim": "c", "command": "python x.py", "test": "0>1",
                                                  "effect": "1", "seeds": "3", "status": "measured"}

    def write(*lines):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=report.PLAN_FIELDS)
            w.writeheader()
            w.writerows(lines)

    write(good)
    assert report.read_plan(path)[("1", "c", "python x.py")]["effect"] == "1"
    for bad in ({"status": "done"}, {"test": "0=1"}, {"effect": ""}, {"redecide": "margin set after the run"}):
        write(good | bad)
        with pytest.raises(ValueError):
            report.read_plan(path)
    write(good, good)
    with pytest.raises(ValueError, match="a second plan"):
        report.read_plan(path)


def test_mean_std_formats():
    from benchmarks._results import mean_std

    assert mean_std([]) == "-" and mean_std([0.5], 100) == "50.0" and mean_std([0.5], 100, bare_single=False) == "50.0 ± 0.0"
    assert mean_std([1.0, 3.0], digits=2) == "2.00 ± 1.41"  # the sample std (n - 1)


def test_provenance_marks_code_that_differs_from_its_commit(tmp_path, monkeypatch):
    """A result row records the commit of the code that made it: a tracked file changed since that commit adds
    "+dirty"; the results CSVs the run itself appends to do not."""
    import subprocess

    from benchmarks import _results as R

    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (results / "x.csv").write_text("row\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "c"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True, capture_output=True)
    monkeypatch.setattr(R, "RESULTS", results)
    clean = R.provenance()["commit"]
    assert clean != "unknown" and not clean.endswith("+dirty")
    (results / "x.csv").write_text("row\nanother row\n")
    assert R.provenance()["commit"] == clean
    (tmp_path / "code.py").write_text("a = 2\n")
    assert R.provenance()["commit"] == clean + "+dirty"


def test_a_results_block_drops_the_pages_own_title_and_keeps_the_rest(tmp_path, monkeypatch):
    """A results page that stands alone (its first line a '# title') is embedded under the section's own heading:
    the title goes, the text and links (made relative to benchmarks/README.md) stay; a page without one is unchanged."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    (tmp_path / "page.md").write_text("# A page\n\nText, [a link](benchmarks/results/pretrained.csv).\n# not a title\n")
    (tmp_path / "plain.md").write_text("| a |\n|---|\n")
    out = report.render("<!-- results:page -->\n<!-- /results:page -->\n<!-- results:plain -->\nold\n"
                        "<!-- /results:plain -->\n")
    assert out == ("<!-- results:page -->\nText, [a link](results/pretrained.csv).\n# not a title\n"
                   "<!-- /results:page -->\n<!-- results:plain -->\n| a |\n|---|\n<!-- /results:plain -->\n")


def test_a_plan_affords_more_seeds_only_where_a_seed_is_quick():
    """A row affords MAX_SEEDS seeds per arm, or what ROW_CORE_HOURS of one core buy at its pilot's seed_s when that
    is more."""
    line = lambda pilot: {"pilot": pilot}  # noqa: E731
    assert report.plan_afford(line("delta=1.3; sd=3,3; n=10,10")) == report.MAX_SEEDS
    assert report.plan_afford(line("delta=1.3; sd=3,3; n=10,10; seed_s=13")) == 3600 * report.ROW_CORE_HOURS // 13
    assert report.plan_afford(line("delta=1.3; sd=3,3; n=10,10; seed_s=900")) == report.MAX_SEEDS


def test_describe_comparison_places_the_interval_without_a_verdict():
    """Results tables' prose describes one comparison (difference, Welch interval, where it lies); it never says
    yes / no / inconclusive, which are the claims table's verdicts."""
    desc = report.describe_comparison
    clear, spans = [(50.0, 2.0, 3), (40.0, 3.0, 3)], [(44.0, 2.0, 3), (40.0, 3.0, 3)]
    assert desc("0>1", clear) == "+10.0 [+3.9, +16.1], clear of 0 the claimed way"
    assert desc("0<1", clear).endswith("clear of 0 the other way")
    assert desc("0>1", spans).endswith(", 0 inside")
    assert desc("0~1", clear).endswith(", clear of 0") and desc("0~1", spans).endswith(", 0 inside")
    assert desc("0~1", [(50.0, 0.5, 5), (50.3, 0.5, 5)], 2, "2.0").endswith("inside the margin")
    assert desc("0~1", [(50.0, 0.5, 5), (51.8, 0.5, 5)], 2, "2.0").endswith("across the margin's edge")
    assert desc("0>1", [(90.0, 1.0, 2), (10.0, 1.0, 2)]).endswith("(2 seeds in an arm, too few to place it)")
    for figs in (clear, spans):
        assert not re.search(r"\b(yes|no|inconclusive)\b", desc("0>1", figs))


def test_split_runs_keeps_each_run_in_a_table_of_its_own():
    """A results table pools no seeds of different runs: the first run's seeds, then each fresh run's range."""
    from benchmarks._results import fresh_run_tables, split_runs

    m = lambda v: {"acc": v}  # noqa: E731
    by = {"a": {"0": m(0.5), "1": m(0.7), "10": m(0.1), "11": m(0.3), "100": m(0.9)},
          "b": {"0": m(0.4), "2": m(0.6), "10": m(0.2)}}
    parts = split_runs(by, ((10, 19), (100, 199), (300, 399)))
    assert [r for r, _ in parts] == [None, (10, 19), (100, 199)]  # a range without rows gets no part
    assert parts[0][1] == {"a": {"0": m(0.5), "1": m(0.7)}, "b": {"0": m(0.4), "2": m(0.6)}}
    assert parts[2][1] == {"a": {"100": m(0.9)}}  # an arm without seeds in a run is left out of its table
    lines = fresh_run_tables(parts[1:], [("acc", "acc", 100, 1)], arms=("b", "a"))
    assert "| b | 20.0 | 10 |" in lines and "| a | 20.0 ± 14.1 | 10-11 |" in lines
    assert lines.index("| b | 20.0 | 10 |") < lines.index("| a | 20.0 ± 14.1 | 10-11 |")  # in the order of arms
    assert sum(line.startswith("Seeds ") for line in lines) == 2 and "| a | 90.0 | 100 |" in lines
    # a column that no arm of a run recorded is left out of that run's table; arms given as an iterator serve every run
    two = fresh_run_tables(parts[1:], [("acc", "acc", 100, 1), ("new", "new", 1, 1)], arms=iter(("b", "a")))
    assert "| arm | acc | seeds |" in two and "| a | 90.0 | 100 |" in two
    with_new = fresh_run_tables([((0, 1), {"a": {"0": {"acc": 0.5, "new": 2.0}}})], [("acc", "acc", 100, 1),
                                                                                    ("new", "new", 1, 1)])
    assert "| arm | acc | new | seeds |" in with_new and "| a | 50.0 | 2.0 | 0 |" in with_new
    # the population std (n) for the files whose tables use it: 0.1 and 0.3 are 0.1 from their mean
    assert "| a | 20.0 ± 10.0 | 10-11 |" in fresh_run_tables(parts[1:2], [("acc", "acc", 100, 1)], population_std=True)



def test_metric_lists_pivot_a_run_to_lists_per_metric():
    from benchmarks._results import metric_lists

    by = metric_lists({"a": {"0": {"acc": 0.5, "len": 3.0}, "1": {"acc": 0.7}}, "b": {"0": {"acc": 0.4}}})
    assert by["a"]["acc"] == [0.5, 0.7] and by["a"]["len"] == [3.0] and by["b"]["acc"] == [0.4]


def test_mean_accuracy_over_a_budget_rewards_learning_sooner():
    """`acc_auc` of prompt_selection, replay and tree_rollout (benchmarks/_results.mean_over_budget): the area under
    the accuracy curve to a budget, linear between evaluations, cut at the budget and flat after the last evaluation,
    divided by the budget; of two runs that end level, the one that got there sooner has the larger area."""
    from benchmarks._results import mean_over_budget

    assert mean_over_budget([(0, 0.0), (5120, 1.0), (10240, 1.0)], 10240) == pytest.approx(0.75)
    assert mean_over_budget([(0, 0.0), (20480, 1.0)], 10240) == pytest.approx(0.25)  # the segment is cut at the budget
    assert mean_over_budget([(0, 0.2), (4000, 0.4)], 10240) == pytest.approx((4000 * 0.3 + 6240 * 0.4) / 10240)
    late = mean_over_budget([(0, 0.2), (8, 0.2), (16, 0.5), (40, 0.5)], 40)
    early = mean_over_budget([(0, 0.2), (8, 0.5), (16, 0.5), (40, 0.5)], 40)
    assert early > late
