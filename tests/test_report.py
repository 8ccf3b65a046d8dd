"""The claims table (benchmarks/results/claims.csv): every figure it quotes comes from a committed results CSV.

For each row: all columns are filled, the direction is one of yes / no / inconclusive, the command runs an existing
script, the paper is named by title and arXiv id, every figure named in `figures` is recomputed from its results
CSV and found, formatted, in `ours` together with its number of seeds, and the verdict is the one
benchmarks/report.py's rule gives (Welch's 95% interval on the difference of seed means, at least 3 seeds per arm,
an equivalence margin for '~' rows; tests below pin the rule itself).
"""
import csv
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

ROWS = report.read_claims()


def test_claims_csv_has_the_columns():
    with open(report.RESULTS / "claims.csv", newline="") as f:
        assert next(csv.reader(f)) == report.CLAIM_FIELDS
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
    assert row["direction"] == report.row_verdict(row)


def test_welch_interval_matches_scipy_on_raw_seeds():
    from scipy import stats

    a, b = [50.1, 47.3, 52.8, 49.0], [44.0, 46.5, 41.2]
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    st = lambda v: (sum(v) / len(v), stats.tstd(v), len(v))  # noqa: E731
    lo, hi = report.welch_interval(st(a), st(b))
    assert abs(lo - ci.low) < 1e-9 and abs(hi - ci.high) < 1e-9
    lo, hi = report.welch_interval(st(a), (40.0, 0.0, 3))  # one arm without spread: t with n_a - 1 dof
    half = stats.t.ppf(0.975, len(a) - 1) * st(a)[1] / len(a) ** 0.5
    assert abs(lo - (st(a)[0] - 40.0 - half)) < 1e-9 and abs(hi - (st(a)[0] - 40.0 + half)) < 1e-9


def test_direction_rule():
    rule = report.expected_direction
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
    # a noisier measurement of the same means can only lose a "yes" (the old rule made it likelier)
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
    figs[2] = figs[3] = (0.001, 0.0, 1)
    assert d("0>1", "exact se=2,-", "", figs).verdict == "yes"
    with pytest.raises(ValueError):
        report.parse_kind("seeded se=2,3")


def test_sample_std_for_population_std_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    head = "bench,script,config,seed,metric,value,command,commit,hardware,versions,timestamp\n"
    (tmp_path / "world_models.csv").write_text(head + "b,s,c,0,m,1.0,,,,,\nb,s,c,1,m,3.0,,,,,\n")
    assert report.figure("world_models.csv#s#c#m#1")[1] == 1.0  # its table quotes the population std
    assert abs(report.sample_stats("world_models.csv#s#c#m#1")[1] - 2 ** 0.5) < 1e-12  # the rule uses n - 1


def test_figure_reads_the_later_of_duplicate_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    head = "bench,script,config,seed,metric,value,command,commit,hardware,versions,timestamp\n"
    rows = ["b,s,c,0,m,1.0,,,,,", "b,s,c,1,m,3.0,,,,,", "b,s,c,0,m,2.0,,,,,", "b,s,other,0,m,9.0,,,,,"]
    (tmp_path / "x.csv").write_text(head + "\n".join(rows) + "\n")
    mean, sd, n = report.figure("x.csv#s#c#m#1")
    assert (mean, n) == (2.5, 2) and abs(sd - 0.7071) < 1e-3
    with pytest.raises(ValueError):
        report.figure("x.csv#s#missing#m#1")


def test_mean_std_formats():
    from benchmarks._results import mean_std

    assert mean_std([]) == "-" and mean_std([0.5], 100) == "50.0" and mean_std([0.5], 100, bare_single=False) == "50.0 ± 0.0"
    assert mean_std([1.0, 3.0], digits=2) == "2.00 ± 1.41"  # the sample std (n - 1)
