"""algos/tree_rollout_adv.py: TreeRL's and TreePO's advantages against naive loops and closed forms, the per-token
clipped loss against a per-row loop, --adv leaf = the parent's GRPO advantage."""
import numpy as np
import pytest
import torch

from _tree_policy import TABLE3, TablePolicy, tree_args
from algos import grpo, tree_rollout_adv as ta


def random_tree(rng, G, M):
    parents, starts, lengths = [], [], []
    for i in range(G):
        if i < M:
            parents.append(-1), starts.append(0)
        else:
            j = int(rng.integers(0, i))
            while lengths[j] - starts[j] < 2:
                j = int(rng.integers(0, i))
            parents.append(j), starts.append(int(rng.integers(starts[j] + 1, lengths[j])))
        lengths.append(starts[-1] + int(rng.integers(1, 6)))
    return parents, starts, lengths


def naive_token_id(parents, starts, i, t):
    return (i, t) if t >= starts[i] else naive_token_id(parents, starts, parents[i], t)


def naive_through(tree, i, t):
    """The leaves whose path holds the same tree token as leaf i at position t."""
    parents, starts, lengths = tree
    me = naive_token_id(parents, starts, i, t)
    return frozenset(l for l in range(len(parents)) if t < lengths[l] and naive_token_id(parents, starts, l, t) == me)


def naive_treerl(tree, r, sqrt_weight):
    G, out = len(r), []
    for i in range(G):
        row = []
        for t in range(tree[2][i]):
            s = naive_through(tree, i, t)
            t0 = t
            while t0 > 0 and naive_through(tree, i, t0 - 1) == s:
                t0 -= 1
            parent = naive_through(tree, i, t0 - 1) if t0 > 0 else frozenset(range(G))
            v = lambda leaves: sum(r[l] for l in leaves) / len(leaves)  # noqa: E731
            others = [l for l in range(G) if l not in s]
            a = (v(s) - v(others) if others else 0.0) + v(s) - v(parent)
            row.append(a / len(s) ** 0.5 if sqrt_weight else a)
        out.append(row)
    return out


def naive_treepo(tree, r):
    G = len(r)
    raw = []
    for i in range(G):
        groups = {frozenset(range(G))} | {naive_through(tree, i, t) for t in range(tree[2][i])}
        groups = [s for s in groups if len(s) >= 2]
        raw.append(sum(r[i] - sum(r[l] for l in s) / len(s) for s in groups) / len(groups))
    raw = np.array(raw)
    return (raw - raw.mean()) / (raw.std(ddof=1) + 1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_tree_advantages_against_naive_loops(seed):
    rng = np.random.default_rng(seed)
    G, M = 9, 1 + seed % 3
    tree = random_tree(rng, G, M)
    r = rng.integers(0, 2, G).astype(float) if seed % 2 else rng.random(G)
    nodes = ta.tree_nodes(*tree)
    for sqrt_weight in (True, False):
        seg = ta.treerl_advantages(torch.tensor(r), nodes, sqrt_weight)
        want = naive_treerl(tree, r, sqrt_weight)
        for i, row in enumerate(nodes[0]):
            assert seg[row].tolist() == pytest.approx(want[i], abs=1e-9)
    assert ta.treepo_advantages(torch.tensor(r), nodes).tolist() == pytest.approx(naive_treepo(tree, r).tolist(), abs=1e-9)


def test_closed_forms_at_depth_zero():
    """No branching (M = G chains): TreeRL gives (2G - 1) / (G - 1) (r_i - mean) on every token, TreePO is GRPO's
    advantage, the leave-one-out advantage is G / (G - 1) (r_i - mean) and sums to zero in every group."""
    torch.manual_seed(0)
    G = 8
    for r in (torch.rand(G, dtype=torch.float64), (torch.rand(G) > 0.5).double()):
        lengths = torch.randint(1, 7, (G,)).tolist()
        nodes = ta.tree_nodes([-1] * G, [0] * G, lengths)
        seg = ta.treerl_advantages(r, nodes, True)
        for i, row in enumerate(nodes[0]):
            assert torch.allclose(seg[row], (2 * G - 1) / (G - 1) * (r[i] - r.mean()).expand(len(row)))
        assert torch.allclose(ta.treepo_advantages(r, nodes), grpo.group_advantages(r, G))
    rewards = torch.rand(5 * G, dtype=torch.float64)
    loo = ta.loo_advantages(rewards, G).view(5, G)
    assert torch.allclose(loo.sum(1), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    r = rewards.view(5, G)
    assert torch.allclose(loo, G / (G - 1) * (r - r.mean(1, keepdim=True)))


def test_per_token_clipped_loss_against_a_loop():
    """One advantage per token: each token's loss is the per-sequence loss of a one-token row with that advantage;
    one advantage per sequence is grpo.py's loss."""
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    loss, clipped = ta.clipped_pg_loss(logp, old, adv, 0.2, 0.28)
    for b in range(3):
        for t in range(5):
            want = grpo.clipped_pg_loss(logp[b:b + 1, t:t + 1], old[b:b + 1, t:t + 1], adv[b, t:t + 1], 0.2, 0.28)
            assert torch.equal(loss[b, t], want[0][0, 0]) and torch.equal(clipped[b, t], want[1][0, 0])
    assert clipped.any() and torch.equal(ta.clipped_pg_loss(logp, old, adv[:, 0], 0.2, 0.28)[0],
                                         grpo.clipped_pg_loss(logp, old, adv[:, 0], 0.2, 0.28)[0])


def test_leaf_advantages_are_the_parents_and_treerl_is_per_token():
    args = tree_args(ta, chains=2, rounds=1, branches=1, continuations=2, adv="leaf")
    trees, _ = ta.grow_trees(TablePolicy(TABLE3, 6), [3] * 4, args, np.random.default_rng(0), len)
    rewards = torch.tensor([float(l["tokens"][-1] == 0) for t in trees for l in t])
    assert torch.equal(ta.tree_advantages(rewards, trees, args, 6), grpo.group_advantages(rewards, args.group_size))
    per_token = ta.tree_advantages(rewards, trees, tree_args(ta, chains=2, rounds=1, continuations=2, adv="treerl"), 6)
    assert per_token.shape == (len(rewards), 6)
