"""algos/branch_grpo_flow.py: the SDE sampler, the tree rollout against DanceGRPO, fused values and depth-wise
advantages against a naive loop, the log-probs the trainer recomputes, NFE counts, pruning, learning."""
import copy
import math
import statistics
from dataclasses import replace

import pytest
import torch

from algos import branch_grpo_flow as bf

SMALL = bf.Args(modes=4, denoise_steps=8, branch_steps=(0, 2, 4), branch_factor=2, prompts_per_iter=3, group_size=8,
                minibatches=1)


def small_model(seed=0):
    torch.manual_seed(seed)
    return bf.VelocityNet(SMALL.modes, 16)


def perturbed(model, seed=1, scale=0.05):
    """A copy with slightly moved weights, so that ratios differ from 1 and clipping is active."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return m


def rollout_batch(args, model, seed=1, prompts=(0, 2, 3), it=0):
    prompts = torch.tensor(prompts)
    ro = bf.rollout(model, prompts, args, bf.sde_steps(args, it), torch.Generator().manual_seed(seed))
    leaf = ro["levels"][-1]
    r = bf.reward(leaf["x"], prompts[leaf["tree"]], bf.ring_means(args.modes, args.radius), args.reward_scale)
    return ro, r, bf.build_batch(ro, r, args)


def loss_and_grads(model, batch, args):
    model.zero_grad()
    e = batch["edges"]
    ids, lp = bf.edge_logprobs(model, batch, torch.arange(len(batch["rows"]["x"])), args)
    loss = bf.ppo_loss(lp, e["lp"][ids], e["pos"][ids], e["neg"][ids], args.clip_eps).sum() / e["w"].sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ---- the sampler ----
def test_sde_keeps_the_flow_marginals():
    """With the exact velocity of a Gaussian target N(m, s^2 I), the ODE and the SDE (any eta) both end at it."""
    m, s = torch.tensor([1.0, -0.5]), 0.3

    def velocity(x, t, c):  # E[x1 - z | x_t] for x_t = t x1 + (1 - t) z
        t = t[:, None]
        var = t ** 2 * s ** 2 + (1 - t) ** 2
        return m + t * s ** 2 * (x - t * m) / var - (1 - t) * (x - t * m) / var

    g = torch.Generator().manual_seed(0)
    for eta in (0.0, 1.0, 1.5):
        x, T = torch.randn(20000, 2, generator=g), 200
        for k in range(T):
            mean, std = bf.sde_step(velocity, x, k, None, T, eta)
            x = mean + std[:, None] * torch.randn(x.shape, generator=g)
        assert torch.allclose(x.mean(0), m, atol=0.02), (eta, x.mean(0))
        assert torch.allclose(x.std(0), torch.tensor([s, s]), rtol=0.04), (eta, x.std(0))


def test_gaussian_logprob_matches_torch():
    mean, x, std = torch.randn(5, 2), torch.randn(5, 2), torch.rand(5) + 0.1
    ref = torch.distributions.Normal(mean, std[:, None]).log_prob(x).sum(-1)
    assert torch.allclose(bf.gaussian_logprob(x, mean, std), ref, atol=1e-5)


# ---- BranchGRPO against the DanceGRPO baseline ----
@pytest.mark.parametrize("fusion", ["mean", "prob"])
def test_one_split_at_step_0_with_factor_G_equals_dance(fusion):
    G, model = 4, small_model()
    dance = replace(SMALL, mode="dance", group_size=G, fusion=fusion)
    branch = replace(dance, mode="branch", branch_steps=(0,), branch_factor=G)
    runs = {}
    for name, args in (("dance", dance), ("branch", branch)):
        ro, r, batch = rollout_batch(args, model)
        runs[name] = (ro, r, batch, *loss_and_grads(perturbed(model), batch, args))
    (ro_d, r_d, b_d, loss_d, g_d), (ro_b, r_b, b_b, loss_b, g_b) = runs["dance"], runs["branch"]
    assert torch.allclose(ro_d["levels"][-1]["x"], ro_b["levels"][-1]["x"], atol=1e-6)  # the same samples
    for name in ("x_next", "lp", "pos", "neg", "w"):  # the same edges with the same advantages
        assert torch.allclose(b_d["edges"][name], b_b["edges"][name], atol=1e-5), name
    assert b_d["edges"]["pos"].sum() > 0
    assert torch.allclose(loss_d, loss_b, atol=1e-6)
    for a, b in zip(g_d, g_b):
        assert torch.allclose(a, b, atol=1e-6)
    assert ro_d["nfe"] == ro_b["nfe"] + (G - 1) * 3  # step 0: G model calls per prompt vs one


@pytest.mark.parametrize("advantage,fusion", [("depthwise", "mean"), ("depthwise", "prob"), ("uniform", "mean")])
def test_no_split_gives_zero_advantage_and_zero_gradient(advantage, fusion):
    args = replace(SMALL, branch_steps=(), advantage=advantage, fusion=fusion)  # one chain per prompt
    ro, r, batch = rollout_batch(args, small_model())
    e = batch["edges"]
    assert len(e["row"]) == 3 * args.denoise_steps
    assert e["pos"].abs().max() == 0 and e["neg"].abs().max() == 0
    _, grads = loss_and_grads(perturbed(small_model()), batch, args)
    assert all(g.abs().max() == 0 for g in grads)


# ---- fused values and advantages against a naive recursive loop ----
def random_levels(seed, n_trees=3, depth=5):
    """Random trees: every node gets 1-3 children; random edge log-probs."""
    g = torch.Generator().manual_seed(seed)
    levels = [{"x": torch.zeros(n_trees, 2), "tree": torch.arange(n_trees)}]
    for _ in range(depth):
        n = len(levels[-1]["x"])
        parent = torch.arange(n).repeat_interleave(torch.randint(1, 4, (n,), generator=g))
        levels.append({"x": torch.zeros(len(parent), 2), "tree": levels[-1]["tree"][parent], "parent": parent,
                       "lp": 3 * torch.randn(len(parent), generator=g)})
    return levels, torch.rand(len(levels[-1]["x"]), generator=g)


def naive(levels, leaf_r, fusion, clip=5.0):
    T = len(levels) - 1
    children = {(k, i): [] for k in range(T) for i in range(len(levels[k]["x"]))}
    for k in range(1, T + 1):
        for i, p in enumerate(levels[k]["parent"].tolist()):
            children[(k - 1, p)].append(i)

    def leaves(k, i):
        return [i] if k == T else [leaf for j in children[(k, i)] for leaf in leaves(k + 1, j)]

    def value(k, i):
        if k == T:
            return leaf_r[i].item()
        kids = children[(k, i)]
        if fusion == "mean":
            ls = leaves(k, i)
            return sum(leaf_r[j].item() for j in ls) / len(ls)
        w = torch.softmax(torch.stack([levels[k + 1]["lp"][j] for j in kids]), 0).tolist()
        return sum(wj * value(k + 1, j) for wj, j in zip(w, kids))

    def standardise(vals):
        if len(vals) < 2 or statistics.stdev(vals) < 1e-6:
            return [0.0] * len(vals)
        mu, sd = statistics.mean(vals), statistics.stdev(vals)
        return [max(-clip, min(clip, (v - mu) / (sd + 1e-8))) for v in vals]

    depthwise, uniform = {}, {}
    for tree in range(len(levels[0]["x"])):
        leaf_ids = [i for i in range(len(leaf_r)) if levels[T]["tree"][i] == tree]
        leaf_adv = dict(zip(leaf_ids, standardise([leaf_r[i].item() for i in leaf_ids])))
        for k in range(1, T + 1):
            ids = [i for i in range(len(levels[k]["x"])) if levels[k]["tree"][i] == tree]
            for i, a in zip(ids, standardise([value(k, i) for i in ids])):
                depthwise[(k, i)] = a
                below = [leaf_adv[j] for j in leaves(k, i)]
                uniform[(k, i)] = (sum(max(a, 0) for a in below), sum(min(a, 0) for a in below), len(below))
    return depthwise, uniform



def test_node_values_on_a_hand_built_tree():
    """Two trees. Tree 0: root -> A, B; A -> leaves 1, 3; B -> leaf 5. Tree 1: root -> C -> leaves 2, 4, 6.
    Mean fusion is the mean of the leaves below: R(A) = 2, R(B) = 5, R(root 0) = (1 + 3 + 5) / 3 = 3 (the plain
    mean of the children would give 3.5), R(C) = R(root 1) = 4. Prob fusion weights the children by the softmax
    of their edge log-probs within the parent: A, B have log-probs (0, log 3) -> weights (1/4, 3/4); A's leaves
    (0, log 3) -> R(A) = 1/4 + 9/4 = 2.5; B's only leaf has weight 1 whatever its log-prob (7) -> R(B) = 5;
    R(root 0) = 2.5 / 4 + 15 / 4 = 4.375. C's leaves (log 2, 0, 0) -> (1/2, 1/4, 1/4) -> R(C) = 3.5, and
    R(root 1) = 3.5 (C is an only child). Catches: the children's plain mean, a softmax over the whole level
    instead of within each parent (B's log-prob 7 would take the weight), -log p, unnormalised weights, prob
    fusion falling back to the mean (tree 1), and wrong leaf counts."""
    l3, l2 = math.log(3.0), math.log(2.0)
    levels = [{"x": torch.zeros(2, 2), "tree": torch.tensor([0, 1])},
              {"x": torch.zeros(3, 2), "tree": torch.tensor([0, 0, 1]), "parent": torch.tensor([0, 0, 1]),
               "lp": torch.tensor([0.0, l3, -2.0])},
              {"x": torch.zeros(6, 2), "tree": torch.tensor([0, 0, 0, 1, 1, 1]),
               "parent": torch.tensor([0, 0, 1, 2, 2, 2]), "lp": torch.tensor([0.0, l3, 7.0, l2, 0.0, 0.0])}]
    leaf_r = torch.tensor([1.0, 3.0, 5.0, 2.0, 4.0, 6.0])
    vals, count = bf.node_values(levels, leaf_r, "mean")
    assert [v.tolist() for v in vals] == [pytest.approx(v) for v in ([3.0, 4.0], [2.0, 5.0, 4.0], leaf_r.tolist())]
    assert [c.tolist() for c in count] == [[3, 3], [2, 1, 3], [1] * 6]
    vals, count = bf.node_values(levels, leaf_r, "prob")
    assert [v.tolist() for v in vals] == [pytest.approx(v) for v in ([4.375, 3.5], [2.5, 5.0, 3.5], leaf_r.tolist())]
    assert [c.tolist() for c in count] == [[3, 3], [2, 1, 3], [1] * 6]

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fusion", ["mean", "prob"])
def test_advantages_match_a_naive_recursive_loop(seed, fusion):
    levels, leaf_r = random_levels(seed)
    depthwise, uniform = naive(levels, leaf_r, fusion)
    got_d = bf.advantages(levels, leaf_r, replace(SMALL, fusion=fusion, advantage="depthwise"))
    got_u = bf.advantages(levels, leaf_r, replace(SMALL, fusion=fusion, advantage="uniform"))
    for (k, i), a in depthwise.items():
        pos, neg, w = (t[i].item() for t in got_d[k])
        assert pos + neg == pytest.approx(a, abs=1e-5) and min(pos, -neg) == 0 and w == 1
        assert tuple(t[i].item() for t in got_u[k]) == pytest.approx(uniform[(k, i)], abs=1e-5)
    assert any(abs(a) > 0.5 for a in depthwise.values())


# ---- the log-probs the trainer recomputes ----
@pytest.mark.parametrize("change", [{}, {"mode": "dance"}, {"mix_window": 3}, {"edge_once": False},
                                    {"width_keep": 0.5, "depth_prune": (3, 7)}])
def test_stored_logprobs_equal_the_recomputed_ones_at_epoch_0(change):
    args = replace(SMALL, **change)
    model = small_model()
    _, _, batch = rollout_batch(args, model)
    m = bf.update(model, torch.optim.Adam(model.parameters(), lr=1e-2), batch, args, torch.Generator())
    assert m["rollout/logprob_mismatch"] < 1e-5
    # the check can fail: scoring each edge at the wrong time step is caught
    bad = {**batch, "rows": {**batch["rows"], "k": (batch["rows"]["k"] + 1).clamp(max=args.denoise_steps - 1)}}
    ids, lp = bf.edge_logprobs(small_model(), bad, torch.arange(len(bad["rows"]["x"])), args)
    assert (lp - batch["edges"]["lp"][ids]).abs().max() > 1e-2


def test_replicated_leaf_paths_equal_each_edge_once_with_the_summed_terms():
    """Uniform advantage: training each leaf's path as its own chain gives the same loss and gradient as computing
    every shared edge once, with fewer model calls."""
    args = replace(SMALL, advantage="uniform")
    model = small_model()
    once = rollout_batch(args, model)[2]
    rep = rollout_batch(replace(args, edge_once=False), model)[2]
    l1, g1 = loss_and_grads(perturbed(model), once, args)
    l2, g2 = loss_and_grads(perturbed(model), rep, args)
    assert torch.allclose(l1, l2, atol=1e-6) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))
    assert len(once["rows"]["x"]) < len(rep["rows"]["x"]) == 3 * 8 * args.denoise_steps


# ---- NFE and pruning ----
def closed_form_nfe(a, prompts, sde):
    """Rollout and training model calls per iteration, from the tree's shape alone."""
    T = a.denoise_steps
    roots, splits = (a.group_size, ()) if a.mode == "dance" else (1, a.branch_steps)
    n = [roots * a.branch_factor ** sum(s < k for s in splits) for k in range(T + 1)]  # nodes per level per tree
    kept = max(2, int(n[T] * a.width_keep)) if a.width_keep < 1 else n[T]
    train = 0
    for k in range(T):  # edges of step k go into level k + 1
        if sde[k] and k + 1 not in a.depth_prune:
            chains = a.width_keep < 1 and k > max(splits)
            train += (kept if chains else n[k]) if a.edge_once else (kept if chains else n[T])
    return prompts * sum(n[:T]), prompts * train * a.epochs


@pytest.mark.parametrize("change", [{}, {"mode": "dance"}, {"branch_factor": 3, "branch_steps": (1, 5)},
                                    {"width_keep": 0.5}, {"width_keep": 0.3, "depth_prune": (1, 4, 8)},
                                    {"mix_window": 2}, {"edge_once": False, "width_keep": 0.5},
                                    {"epochs": 2, "minibatches": 3}])
def test_nfe_counters_equal_their_closed_form(change):
    args = replace(SMALL, **change)
    model = small_model()
    ro, _, batch = rollout_batch(args, model, it=4)
    m = bf.update(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, args, torch.Generator())
    rollout_nfe, train_nfe = closed_form_nfe(args, 3, bf.sde_steps(args, 4))
    assert (ro["nfe"], m["perf/train_nfe"]) == (rollout_nfe, train_nfe)


def test_closed_form_ratio_of_the_default():
    rollout_nfe, _ = closed_form_nfe(bf.Args(), 1, [True] * 20)
    assert rollout_nfe / 16 / 20 == pytest.approx(203 / 320)  # 12.69 model calls per leaf vs DanceGRPO's 20


def test_pruning_keeps_exactly_the_promised_edges():
    args = replace(SMALL, width_keep=0.5, depth_prune=(2, 6))  # T = 8, splits 0 2 4: 8 leaves, last split at 4
    ro, r, batch = rollout_batch(args, small_model())
    levels, T = ro["levels"], args.denoise_steps
    where = {tuple(x): (k, i) for k in range(1, T + 1) for i, x in enumerate(levels[k]["x"].tolist())}
    got = {where[tuple(x)] for x in batch["edges"]["x_next"].tolist()}
    want = set()
    for tree in range(3):
        leaves = sorted((i for i in range(len(r)) if levels[T]["tree"][i] == tree), key=lambda i: -r[i].item())
        kept = set(leaves[:2] + leaves[-2:])  # 8 chains * 0.5 = 4: the best two and the worst two
        for leaf in leaves:
            node = leaf
            for k in range(T, 0, -1):  # edges into levels 6..8 come after the last split: only kept chains
                if k not in args.depth_prune and (k <= 5 or leaf in kept):
                    want.add((k, node))
                node = levels[k]["parent"][node].item()
    assert got == want
    assert len([e for e in got if e[0] == 8]) == 3 * 4 and not [e for e in got if e[0] in (2, 6)]


def test_mix_window_slides_and_keeps_split_steps_stochastic():
    args = replace(SMALL, mix_window=2, mix_shift_every=3)
    assert bf.sde_steps(args, 0) == [k in (0, 1, 2, 4) for k in range(8)]
    assert bf.sde_steps(args, 9) == [k in (0, 2, 3, 4) for k in range(8)]
    assert bf.sde_steps(args, 10 ** 6) == [k in (0, 2, 4, 6, 7) for k in range(8)]
    ro, _, batch = rollout_batch(args, small_model())
    assert (ro["levels"][6]["lp"] == 0).all() and (ro["levels"][5]["lp"] != 0).all()  # step 5 ODE, step 4 SDE
    assert set(batch["rows"]["k"].tolist()) == {0, 1, 2, 4}


def test_mix_ode_steps_are_the_plain_flow_step():
    """Outside the SDE window a Mix rollout takes the ODE step x + h v (what evaluate()'s ODE samples take), not
    the SDE mean without its noise, whose extra drift -(eta^2/2)(x - t v) h pulls samples together."""
    args, model = replace(SMALL, mix_window=2, mix_shift_every=3), small_model()
    ro, _, _ = rollout_batch(args, model)
    h, c = 1.0 / args.denoise_steps, ro["prompts"]
    with torch.no_grad():
        for k in (3, 5, 6, 7):  # the ODE steps at iteration 0
            prev, nxt = ro["levels"][k], ro["levels"][k + 1]
            x = prev["x"][nxt["parent"]]
            ode = x + h * model(x, torch.full((len(x),), k * h), c[nxt["tree"]])
            assert torch.allclose(nxt["x"], ode, atol=1e-6), k


# ---- learning and bad input ----
@pytest.mark.slow
def test_branch_grpo_learns(tmp_path):
    s = bf.main(bf.Args(iters=80, eval_every=40, threads=1, out_dir=str(tmp_path)))
    # measured: mean reward 0.28 -> 0.83 (seed 0; gains 0.55, 0.55, 0.51 on seeds 0-2), nfe_ratio 0.63, ~5 s
    assert s["reward_end"] - s["reward_start"] > 0.35, s
    assert s["nfe_ratio"] <= 0.7 and s["logprob_mismatch"] < 1e-4
    assert (tmp_path / "branch_grpo_flow" / "branch_grpo_flow.png").stat().st_size > 0


BAD = [({"branch_steps": ()}, "branch-steps"), ({"branch_steps": (3, 1)}, "branch-steps"),
       ({"branch_steps": (20,)}, "branch-steps"), ({"branch_factor": 1}, "branch-factor"),
       ({"width_keep": 0.0}, "width-keep"), ({"mode": "dance", "width_keep": 0.5}, "width-keep"),
       ({"depth_prune": (0,)}, "depth-prune"), ({"mix_window": 21}, "mix-window"),
       ({"mode": "dance", "group_size": 1}, "group-size"), ({"eta": 0.0}, "eta"), ({"hidden": 0}, "--hidden"),
       ({"eval_every": 0}, "--eval-every")]


@pytest.mark.parametrize("change,msg", BAD)
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        bf.main(replace(bf.Args(out_dir=str(tmp_path)), **change))
