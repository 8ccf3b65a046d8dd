"""The claims table (benchmarks/results/claims.csv): every figure it quotes comes from a committed results CSV.

For each row: all columns are filled, the direction is one of yes / no / inconclusive, the command runs an existing
script, the paper is named by title and arXiv id, every figure named in `figures` is recomputed from its results
CSV and found, formatted, in `ours` together with its number of seeds, and where `compare` gives the paper's
direction between two figures, the verdict is the one benchmarks/report.py's rule gives.
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
        if col != "compare":
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
    if row["compare"]:
        assert row["direction"] == report.expected_direction(row["compare"], figs)


def test_direction_rule():
    rule = report.expected_direction
    assert rule("0>1", [(50.0, 2.0, 3), (40.0, 3.0, 3)]) == "yes"
    assert rule("0>1", [(40.0, 2.0, 3), (50.0, 3.0, 3)]) == "no"
    assert rule("0>1", [(42.0, 2.0, 3), (40.0, 3.0, 3)]) == "inconclusive"
    assert rule("0<1", [(40.0, 2.0, 3), (50.0, 3.0, 3)]) == "yes"
    assert rule("0>1", [(1.05, 0.0, 1), (1.0, 0.0, 1)]) == "inconclusive"  # one seed: 10% noise floor
    assert rule("0~1", [(4.3, 0.0, 1), (4.6, 0.0, 1)]) == "yes"
    assert rule("0~1", [(3.0, 0.0, 1), (4.6, 0.0, 1)]) == "no"


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
