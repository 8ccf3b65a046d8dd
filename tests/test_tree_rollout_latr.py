"""algos/tree_rollout_latr.py: forced branch tokens change the branched leaves' law, lookahead pruning keeps G and
counts its windows, a forced EOS ends its branch, resampling without lookahead grows the parent's trees, bad input."""
import math

import numpy as np
import pytest
import torch

import common
from _tree_policy import MARKED, PIECES, TABLE3, TablePolicy, chi_square_p, tree_args
from algos import _tree, tree_rollout_grpo as tr, tree_rollout_latr as latr


def grow(policy, n, args, protect=len, seed=0, eos_ids=()):
    return latr.grow_trees(policy, [3] * n, args, np.random.default_rng(seed), protect, eos_ids)


def test_forced_branch_tokens_are_not_plain_samples():
    """With forced candidates (never the parent's token) the chain keeps the policy's law and the branched leaf does
    not: the marginal test of tests/test_tree_rollout_grpo.py can fail."""
    forced, _ = grow(TablePolicy(TABLE3, 3), 3000, tree_args(latr, branch_token="force", lookahead=0))
    assert chi_square_p(forced, 0) > 1e-3 and chi_square_p(forced, 1) < 1e-6
    assert all(leaf["tokens"][leaf["pos"]] != tree[leaf["parent"]]["tokens"][leaf["pos"]]
               for tree in forced for leaf in tree if leaf["parent"] >= 0 and leaf["pos"] < 3)


def test_resampling_without_lookahead_grows_the_parents_trees():
    """--branch-token resample --lookahead 0 is the parent: the same trees and counts from the same draws."""
    kw = dict(chains=2, rounds=2, branches=2, continuations=2, branch_score="entropy", max_new_tokens=10)
    protect = lambda toks: _tree.answer_start(toks, PIECES, "=")  # noqa: E731
    mine, c1 = grow(TablePolicy(MARKED, 10, eos=3), 40, tree_args(latr, branch_token="resample", lookahead=0, **kw),
                    protect)
    theirs, c2 = tr.grow_trees(TablePolicy(MARKED, 10, eos=3), [3] * 40, tree_args(tr, **kw),
                               np.random.default_rng(0), protect)
    strip = lambda trees: [[{k: v for k, v in l.items() if k != "alts"} for l in t] for t in trees]  # noqa: E731
    assert strip(mine) == strip(theirs) and {k: c1[k] for k in c2} == c2 and c1["forced"] == c1["pruned"] == 0


def test_lookahead_prunes_and_keeps_the_group_size():
    args = tree_args(latr, chains=2, rounds=1, branches=2, continuations=2, branch_token="force", lookahead=2,
                     prune_sim=0.5, max_new_tokens=10)
    trees, counts = grow(TablePolicy(MARKED, 10, eos=3), 100, args, lambda toks: _tree.answer_start(toks, PIECES, "="))
    assert all(len(t) == 10 for t in trees)
    assert 0 < counts["pruned"] <= counts["windows"] == 100 * 8
    # pruned windows were sampled too: more sampled tokens than the kept segments hold
    assert counts["sampled"] > sum(len(l["tokens"]) - l["pos"] for t in trees for l in t)


def test_a_forced_eos_ends_its_branch():
    """When the forced candidate is EOS (id 2 here, often the likeliest alternative), the child is its prefix and the
    EOS, finished, and nothing is sampled after it; EOS is the last token of every leaf that has one."""
    args = tree_args(latr, chains=2, rounds=2, branches=2, continuations=1, branch_token="force", lookahead=0,
                     max_new_tokens=6)
    trees, counts = grow(TablePolicy(TABLE3, 6, eos=2, seed=3), 30, args, eos_ids={2})
    leaves = [leaf for tree in trees for leaf in tree]
    forced_eos = [leaf for leaf in leaves if leaf["parent"] >= 0 and leaf["tokens"][leaf["pos"]] == 2
                  and len(leaf["tokens"]) == leaf["pos"] + 1]
    assert len(forced_eos) > 5 and all(leaf["finished"] for leaf in forced_eos)
    assert all(2 not in leaf["tokens"][:-1] for leaf in leaves)
    assert all(leaf["finished"] == (leaf["tokens"][-1:] == [2]) for leaf in leaves if len(leaf["tokens"]) < 6)
    assert counts["sampled"] == sum(len(l["tokens"]) - l["pos"] for t in trees for l in t)  # forced tokens count once


def test_round_requests_force_the_candidates_in_order_and_lookahead_prune_keeps_them_complete():
    """round_requests: continuation k of a point is forced to its k-th candidate other than the parent's token;
    lookahead_prune: one window per request, the same number of requests back, every one completed (to the budget
    or a finished segment), a pruned request replaced by another point of the same tree."""
    args = tree_args(latr, chains=2, rounds=1, branches=1, continuations=2, branch_token="force", lookahead=2,
                     prune_sim=0.5, max_new_tokens=8)
    policy, n = TablePolicy(TABLE3, 8), 40
    trees, _ = grow(policy, n, tree_args(latr, chains=2, rounds=0, max_new_tokens=8))
    rng = np.random.default_rng(0)
    reqs = latr.round_requests(trees, args, rng)
    assert len(reqs) == n * 2 * 2
    for a, b in zip(reqs[::2], reqs[1::2]):  # the two continuations of one point
        assert (a.group, a.parent, a.pos) == (b.group, b.parent, b.pos) and a.forced and a.forced != b.forced
        parent = trees[a.group][a.parent]
        alts = [c for c in parent["alts"][a.pos] if c[0] != parent["tokens"][a.pos]]
        assert [a.forced, b.forced] == (alts + [None])[:2]
    counts = dict(sampled=0, prefill=0, pruned=0, windows=0, forced=0)
    sample = lambda rs, pres, budgets: latr.sample_requests(policy, rs, pres, budgets, [3] * n, counts)  # noqa: E731
    final, segs = latr.lookahead_prune(list(reqs), trees, args, rng, sample, counts)
    assert len(final) == len(segs) == len(reqs) and counts["windows"] == len(reqs) and counts["pruned"] > 0
    assert all(s["finished"] or len(r.prefix(trees)) + len(s["tokens"]) == 8 for r, s in zip(final, segs))
    moved = [(r, f) for r, f in zip(reqs, final) if r != f]
    assert len(moved) == counts["pruned"] and all(r.group == f.group and r.tree == f.tree for r, f in moved)


def test_sample_segments_lists_the_candidates():
    """The LATR candidates at every position of a sampled segment: probability >= --force-abs and >= --force-rel x
    the most likely token's, most likely first, at most continuations + 1 of them."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    args = tree_args(latr, rounds=1, continuations=3, force_abs=0.02, force_rel=0.05, max_new_tokens=6)
    segs = latr.sample_segments(common.Sampler(model), tok, common.encode_prompts(tok, ["1+2=", "3+4="]), [0, 1],
                                [[], []], [6, 4], args, stats=True)
    for seg, budget in zip(segs, [6, 4]):
        assert len(seg["alts"]) == len(seg["entropy"]) == len(seg["tokens"]) <= budget
        for alts in seg["alts"]:
            lps = [lp for _, lp in alts]
            assert 1 <= len(alts) <= 4 and lps == sorted(lps, reverse=True)
            assert all(lp >= math.log(0.02) - 1e-6 and lp >= lps[0] + math.log(0.05) - 1e-6 for lp in lps)


@pytest.mark.parametrize("change,msg", [({"force_abs": 0.0}, "force-abs"), ({"lookahead": -1}, "lookahead")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        latr.main(latr.Args(out_dir=str(tmp_path), steps=1, exp_name="t", **change))
