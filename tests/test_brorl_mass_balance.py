"""algos/brorl_mass_balance.py: the softmax mass change, the policy-gradient step, the mass balance and the N trend."""
import itertools
from dataclasses import replace

import numpy as np
import pytest

from algos import brorl_mass_balance as bm


def test_first_order_mass_change_matches_finite_differences():
    rng = np.random.default_rng(0)
    z, dz = rng.normal(0, 2, (5, 12)), rng.normal(0, 1, (5, 12))
    pi = bm.softmax(z)
    lin = bm.first_order_mass_change(pi, dz)
    errs = []
    for h in (1e-2, 1e-3, 1e-4):
        fd = (bm.softmax(z + h * dz) - pi) / h
        errs.append(np.abs(fd - lin).max())
    assert errs[-1] < 1e-4 * np.abs(lin).max()
    assert errs[0] / errs[1] > 8 and errs[1] / errs[2] > 8  # the remainder is O(h): first order, not a lucky match
    assert np.allclose(lin.sum(-1), 0, atol=1e-12)  # probability is conserved
    assert np.allclose(bm.mass_change(z, 1e-6 * dz) / 1e-6, lin, atol=1e-4)


def naive_step(pi, samples, correct, lr, baseline, r_wrong):
    r = [1.0 if correct[y] else r_wrong for y in samples]
    b = sum(r) / len(r) if baseline == "mean" else 0.0
    dz = np.zeros_like(pi)
    for y, ri in zip(samples, r):
        e = np.zeros_like(pi)
        e[y] = 1
        dz += (ri - b) * (e - pi)
    return lr / len(samples) * dz


@pytest.mark.parametrize("baseline,r_wrong", [("mean", 0.0), ("none", 0.0), ("none", -1.0), ("mean", -0.5)])
def test_pg_logit_step_against_a_per_sample_loop(baseline, r_wrong):
    rng = np.random.default_rng(1)
    pi = bm.softmax(rng.normal(0, 1.5, 7))
    correct = np.array([1, 0, 0, 1, 0, 1, 0], bool)
    for n in (1, 3, 10):
        samples = rng.choice(7, size=n, p=pi)
        counts = np.bincount(samples, minlength=7).astype(float)
        got = bm.pg_logit_step(pi[None], counts[None], correct[None], 0.3, baseline, r_wrong)[0]
        assert np.allclose(got, naive_step(pi, samples, correct, 0.3, baseline, r_wrong), atol=1e-12)


@pytest.mark.parametrize("baseline,r_wrong", [("mean", 0.0), ("none", -1.0)])
def test_expected_gain_against_exact_enumeration(baseline, r_wrong):
    """E over every ordered sample sequence (V=4, N=3) of the first-order dQ equals the closed form."""
    pi = np.array([0.5, 0.1, 0.3, 0.1])
    correct = np.array([True, False, False, True])
    exact = 0.0
    for seq in itertools.product(range(4), repeat=3):
        counts = np.bincount(seq, minlength=4).astype(float)
        dz = bm.pg_logit_step(pi[None], counts[None], correct[None], 1.0, baseline, r_wrong)
        dq = (bm.first_order_mass_change(pi[None], dz) * correct).sum()
        exact += np.prod(pi[list(seq)]) * dq
    closed = bm.expected_first_order_gain(pi[None], correct[None], 3, 1.0, baseline, r_wrong)[0]
    assert closed == pytest.approx(exact, rel=1e-10)
    # the mean baseline's (N-1)/N: a wrong factor would be off by a third here
    assert closed == pytest.approx(bm.expected_first_order_gain(pi[None], correct[None], 10**9, 1.0, baseline,
                                                                r_wrong)[0] * (2 / 3 if baseline == "mean" else 1))


def test_mass_balance_parts():
    rng = np.random.default_rng(2)
    z, correct = bm.sample_policies(rng, 500, 16, 3, 2.0)
    pi = bm.softmax(z)
    counts = rng.multinomial(8, pi).astype(float)
    for baseline, r_wrong in (("mean", 0.0), ("none", -1.0)):
        dz = bm.pg_logit_step(pi, counts, correct, 0.1, baseline, r_wrong)
        s, u = bm.mass_balance(pi, dz, counts, correct)
        dq1 = (bm.first_order_mass_change(pi, dz) * correct).sum(-1)
        assert np.allclose(s + u, dq1, atol=1e-14)
        if baseline == "mean":  # sampled tokens always add correct mass; unsampled ones have no first-order part
            assert s.min() >= -1e-15 and np.abs(u).max() < 1e-15
        else:  # raw rewards: the net reward moves the unsampled tokens
            assert np.abs(u).max() > 1e-4


def test_probability_that_every_correct_token_gains_rises_with_n(tmp_path):
    args = bm.Args(ns=(1, 4, 16, 64, 256, 1024), trials=2000, out_dir=str(tmp_path))
    rows = bm.simulate(args)
    p = [r["p_all_gain"] for r in rows]
    assert p[0] == 0.0  # N = 1 with a mean baseline: no step at all
    assert all(b > a + 0.02 for a, b in zip(p, p[1:])), p  # measured (seed 0): 0, 18, 45, 69, 80, 82 %
    assert rows[-1]["p_all_gain_if_expected"] > 0.95  # measured 99 %
    assert rows[-1]["p_all_gain_if_not_expected"] < 0.1  # squeezed policies: more rollouts do not help
    for r in rows[1:]:  # the Monte Carlo mean matches the analytic expectation (first order)
        assert abs(r["dq_first_order_mean"] - r["dq_first_order_expected"]) < 4 * r["dq_se"] + 1e-12
        assert r["dq_mean"] > 0


def test_main_writes_csv_table_and_plot(tmp_path):
    s = bm.main(bm.Args(ns=(1, 8, 64), trials=300, out_dir=str(tmp_path), exp_name="t"))
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"t.{ext}").stat().st_size > 0
    import csv

    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert {r["metric"] for r in rows} >= {"p_all_gain_n1", "p_all_gain_n64", "dq_mean_n8"}
    assert rows[0]["command"] == "python algos/brorl_mass_balance.py --exp-name t --out-dir " + str(tmp_path) + \
        " --ns 1 8 64 --trials 300"
    assert s["n_max"] == 64 and s["p_all_gain_first"] == 0.0 and s["sampled_part_min"] >= -1e-15


@pytest.mark.parametrize("change,msg", [({"vocab": 1}, "vocab"), ({"n_correct": 0}, "n-correct"),
                                        ({"n_correct": 32}, "n-correct"), ({"ns": (4, 0)}, "ns"),
                                        ({"ns": ()}, "ns"), ({"trials": 0}, "trials"), ({"r_wrong": 1.0}, "r-wrong")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        bm.main(replace(bm.Args(out_dir=str(tmp_path)), **change))
