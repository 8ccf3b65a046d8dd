"""Test helper for the tree rollout scripts: a toy policy that grow_trees samples from, with known probabilities."""
import numpy as np


class TablePolicy:
    """pi(x_t | x_{t-1}) from a table [V + 1, V] (last row: the first token); stops at `eos` or after `length`.

    Called as grow_trees' sample_fn: (groups, prefixes, budgets) -> segments with logprobs, entropies and the LATR
    candidates (probability >= 0.05 and >= 0.1 x the largest, most likely first)."""

    def __init__(self, table, length, eos=None, ids=None, seed=0):
        self.p = np.asarray(table, dtype=float)
        self.length, self.eos, self.rng = length, eos, np.random.default_rng(seed)
        self.ids = list(range(self.p.shape[1])) if ids is None else ids  # token ids of the table's columns
        self.col = {t: i for i, t in enumerate(self.ids)}

    def __call__(self, groups, prefixes, budgets):
        segs = []
        for pre, budget in zip(prefixes, budgets):
            seg = {"tokens": [], "logprobs": [], "entropy": [], "alts": [], "finished": False}
            prev = self.col[pre[-1]] if pre else len(self.p) - 1
            for _ in range(min(budget, self.length - len(pre))):
                p = self.p[prev]
                x = int(self.rng.choice(len(p), p=p))
                order = [int(i) for i in np.argsort(-p, kind="stable") if p[i] >= 0.05 and p[i] >= 0.1 * p.max()]
                seg["tokens"].append(self.ids[x])
                seg["logprobs"].append(float(np.log(p[x])))
                seg["entropy"].append(float(-(p[p > 0] * np.log(p[p > 0])).sum()))
                seg["alts"].append([(self.ids[i], float(np.log(p[i]))) for i in order])
                prev = x
                if self.ids[x] == self.eos:
                    seg["finished"] = True
                    break
            segs.append(seg)
        return segs


TABLE3 = [[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5], [0.45, 0.35, 0.2]]
MARKED = [[0.45, 0.35, 0.2, 0.0], [0.35, 0.45, 0.2, 0.0], [0.3, 0.3, 0.0, 0.4], [0.5, 0.5, 0.0, 0.0],
          [0.5, 0.5, 0.0, 0.0]]  # tokens a, b, '=' (the answer marker), EOS (id 3, only after '=')
PIECES = ["a", "b", "=", ""]


def tree_args(module, **kw):
    """module.Args for a small tree (one chain, two rounds of one random point x one continuation), G derived."""
    a = dict(chains=1, rounds=2, branches=1, continuations=1, branch_score="random", max_new_tokens=8)
    a.update(kw)
    a["group_size"] = a["chains"] * (1 + a["rounds"] * a["branches"] * a["continuations"])
    return module.Args(**a)


def chi_square_p(trees, k):
    """p-value of leaf k's sequences (length 3 over 3 tokens) against TABLE3's exact probabilities."""
    from scipy import stats

    counts = np.zeros(27)
    for tree in trees:
        a, b, c = tree[k]["tokens"]
        counts[9 * a + 3 * b + c] += 1
    p = np.asarray(TABLE3)
    exact = np.array([p[3, a] * p[a, b] * p[b, c] for a in range(3) for b in range(3) for c in range(3)])
    return stats.chisquare(counts, exact * counts.sum()).pvalue
