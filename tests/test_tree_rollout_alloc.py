"""algos/tree_rollout_alloc.py: the p(1 - p) allocation by hand, growth that branches the uncertain tree and keeps G,
and one round (every p in {0, 1}: an even split) growing the parent's trees."""
import numpy as np

from _tree_policy import TABLE3, TablePolicy, tree_args
from algos import tree_rollout_alloc as al, tree_rollout_grpo as tr


def last_is_zero(g, toks):
    return float(toks[-1] == 0)


def test_allocate_branches_by_hand():
    """p(1 - p) weights: [0.25, 0, 0, 0.1875] -> shares 2.29, 0, 0, 1.71 -> floors 2, 0, 0, 1 and the last point to
    the larger remainder; all-certain trees split evenly; caps move the rest to the open trees."""
    assert al.allocate_branches([0.5, 0.0, 1.0, 0.25], 4, [9] * 4) == [2, 0, 0, 2]
    assert al.allocate_branches([1.0, 0.0, 1.0, 0.0], 4, [9] * 4) == [1, 1, 1, 1]
    assert al.allocate_branches([0.5, 0.5], 4, [1, 10]) == [1, 3]
    assert al.allocate_branches([0.5, 0.5], 5, [1, 1]) == [1, 1]  # no more legal points: the rest stays unplaced
    assert sum(al.allocate_branches([0.3, 0.6, 0.9], 7, [9] * 3)) == 7


def test_pq_allocation_branches_the_uncertain_tree_and_keeps_g():
    """Two chains, two rounds, reward = last token is 0. After round one (two leaves per tree) a group whose tree 0
    has mixed rewards and tree 1 not gives both of round two's points to tree 0; G leaves either way, and the
    parent's even allocation gives each tree one."""
    kw = dict(chains=2, rounds=2, branches=1, continuations=1, max_new_tokens=6)
    trees, _ = al.grow_trees(TablePolicy(TABLE3, 6), [3] * 300, tree_args(al, **kw), np.random.default_rng(0), len,
                             last_is_zero)
    even, _ = tr.grow_trees(TablePolicy(TABLE3, 6), [3] * 300, tree_args(tr, **kw), np.random.default_rng(0), len)
    assert all(len(t) == 6 for t in trees + even)
    one_mixed = 0
    for tree in trees:
        p = [np.mean([l["reward"] for l in tree[:4] if l["tree"] == m]) for m in range(2)]  # after round one
        if p[0] == 0.5 and p[1] in (0.0, 1.0):
            one_mixed += 1
            assert [l["tree"] for l in tree[4:]] == [0, 0]
    assert one_mixed > 30
    assert all(sorted(l["tree"] for l in t[4:]) == [0, 1] for t in even)


def test_one_round_grows_the_parents_trees():
    """In the first round every tree has one leaf (p in {0, 1}): the split is even, and each tree's allocated best
    points are the parent's N best from the same draws."""
    kw = dict(chains=3, rounds=1, branches=2, continuations=2, branch_score="random", max_new_tokens=8)
    mine, c1 = al.grow_trees(TablePolicy(TABLE3, 8), [3] * 50, tree_args(al, **kw), np.random.default_rng(0), len,
                             last_is_zero)
    theirs, c2 = tr.grow_trees(TablePolicy(TABLE3, 8), [3] * 50, tree_args(tr, **kw), np.random.default_rng(0), len)
    assert [[{k: v for k, v in l.items() if k != "reward"} for l in t] for t in mine] == theirs and c1 == c2


def test_round_requests_send_the_points_to_the_mixed_tree():
    """One round by hand: tree 0's leaves have rewards 1 and 0 (p = 0.5), tree 1's both 1 (p = 1): round_requests
    rewards every leaf once (kept on the leaf) and gives both of the group's M N = 2 points to tree 0."""
    leaf = lambda toks, parent, pos, tree: {"tokens": toks, "logprobs": [-1.0] * len(toks), "parent": parent,  # noqa: E731
                                            "pos": pos, "tree": tree, "depth": int(parent >= 0), "protect": len(toks)}
    trees = [[leaf([1, 1, 0], -1, 0, 0), leaf([2, 2, 0], -1, 0, 1), leaf([1, 2, 1], 0, 1, 0), leaf([2, 1, 0], 1, 1, 1)]]
    calls = []
    reward = lambda g, toks: calls.append(g) or last_is_zero(g, toks)  # noqa: E731
    args = tree_args(al, chains=2, rounds=1, branches=1, continuations=1)
    reqs = al.round_requests(trees, args, np.random.default_rng(0), reward)
    assert [l["reward"] for l in trees[0]] == [1.0, 1.0, 0.0, 1.0] and len(calls) == 4
    assert len(reqs) == 2 and {r.tree for r in reqs} == {0} and all(r.parent in (0, 2) for r in reqs)
    al.round_requests(trees, args, np.random.default_rng(0), reward)
    assert len(calls) == 4  # rewards are computed once per leaf
