"""algos/mc_grpo.py: the median-centred advantage, its single pivot, sign flips, graded rewards, and learning."""
import itertools
import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo, mc_grpo as m


def middle(rs):
    """Index of the median of an odd list: the middle of a stable sort (Python's sort is stable)."""
    return sorted(range(len(rs)), key=lambda i: rs[i])[len(rs) // 2]


@pytest.mark.parametrize("n", [3, 5, 9])
def test_median_advantages_against_loop(n):
    torch.manual_seed(n)
    for r in (torch.rand(6 * n), (torch.rand(6 * n) > 0.5).float(), torch.randint(0, 3, (6 * n,)).float() / 2):
        adv, pivot = m.median_advantages(r, n)
        for g in range(6):
            grp = r[g * n:(g + 1) * n].tolist()
            med = statistics.median(grp)
            assert adv[g * n:(g + 1) * n].tolist() == pytest.approx([x - med for x in grp], abs=1e-7)
            piv = pivot[g * n:(g + 1) * n]
            assert int(piv.sum()) == 1 and int(piv.nonzero()) == middle(grp)  # exactly one pivot, at the median
            assert adv[g * n + middle(grp)] == 0


def test_three_rollouts_with_binary_rewards_give_the_minority_label_form():
    """G+1 = 3, 0/1 rewards: the median is the majority label; the minority gets +1 (a lone success) or -1 (a lone
    failure), the majority 0, and the pivot is one of the majority."""
    for pattern in itertools.product([0.0, 1.0], repeat=3):
        adv, pivot = m.median_advantages(torch.tensor(pattern), 3)
        majority = float(sum(pattern) >= 2)
        expected = [0.0 if x == majority else (1.0 if x == 1 else -1.0) for x in pattern]
        assert adv.tolist() == expected, pattern
        assert int(pivot.sum()) == 1 and pattern[int(pivot.nonzero())] == majority


def test_mad_norm_matches_the_authors_loop():
    """--mad-norm against a per-group loop written like the authors' trainer (torch.median, MAD + 1e-3, n/#non-zero)."""
    torch.manual_seed(3)
    n = 5
    r = torch.cat([torch.rand(4 * n), (torch.rand(4 * n) > 0.5).float()])
    adv, _ = m.median_advantages(r, n, mad_norm=True)
    for g in range(8):
        grp = r[g * n:(g + 1) * n]
        a = grp - grp.median()
        a = a / ((grp - grp.median()).abs().median() + 1e-3)
        nz = ~torch.isclose(a, torch.zeros_like(a), atol=1e-6)
        if nz.sum() > 0:
            a[nz] = a[nz] * (n / nz.sum())
        assert torch.allclose(adv[g * n:(g + 1) * n], a, rtol=1e-5)


def test_the_pivot_gets_zero_gradient_and_dropping_it_changes_nothing_else():
    """Full G+1 batch with the pivot's A = 0: the pivot's log-probs get zero gradient, and the kept rows' gradient
    equals that of the batch without the pivot (the normaliser counts the G kept rollouts per prompt)."""
    torch.manual_seed(4)
    P, n, C = 4, 5, 6
    args = m.Args(loss_agg="seq-mean")
    r = torch.rand(P * n)
    adv, pivot = m.median_advantages(r, n)
    logp = (-torch.rand(P * n, C)).requires_grad_()
    mask = (torch.rand(P * n, C) > 0.2).float()
    mask[:, 0] = 1
    mb = {"adv": adv, "mask": mask, "old": logp.detach(), "ref": None}
    loss, _ = m.grpo_loss(logp, mb, P * (n - 1), int(mask[~pivot].sum()), args)
    loss.backward()
    assert torch.all(logp.grad[pivot] == 0) and logp.grad[~pivot].abs().sum() > 0
    kept = logp.detach()[~pivot].clone().requires_grad_()
    mb_k = {"adv": adv[~pivot], "mask": mask[~pivot], "old": kept.detach(), "ref": None}
    loss_k, _ = m.grpo_loss(kept, mb_k, P * (n - 1), int(mask[~pivot].sum()), args)
    loss_k.backward()
    assert torch.allclose(kept.grad, logp.grad[~pivot], atol=1e-7)
    # with a KL term the pivot would receive gradient: that is why the rollout drops it instead of masking its A
    logp.grad = None
    m.grpo_loss(logp, {**mb, "ref": logp.detach() - 0.3}, P * n, int(mask.sum()), replace(args, kl_coef=0.1))[0] \
        .backward()
    assert logp.grad[pivot].abs().sum() > 0


@pytest.fixture(scope="module")
def tiny():
    model, tok = common.load_model("tiny-0.6m", torch.device("cpu"))
    return model, tok, llm.make_task("add", 2)


def test_rollout_drops_one_pivot_per_group(tiny, monkeypatch):
    model, tok, task = tiny
    sampled = {}
    real = common.generate

    def spy(*a, **k):
        sampled["ro"] = real(*a, **k)
        return sampled["ro"]

    monkeypatch.setattr(common, "generate", spy)
    args = m.Args(prompts_per_step=6, group_size=2, reward_noise=0.3)  # noise: distinct rewards, a unique median
    torch.manual_seed(0)
    batch = m.rollout(model, tok, task, args, np.random.default_rng(0), torch.device("cpu"))
    ro = sampled["ro"]
    assert ro.completion_ids.shape[0] == 6 * 3 and batch["completion_ids"].shape[0] == 6 * 2
    torch.manual_seed(0)  # the same noisy training rewards, recomputed from the same draws
    rng = np.random.default_rng(0)
    examples = task.sample("train", 6, rng)
    r = m.train_rewards([task.verify(t, e.answer) for t, e in zip(ro.texts, [e for e in examples for _ in range(3)])],
                        args, rng)
    for g in range(6):
        grp = r[3 * g:3 * g + 3].tolist()
        kept = [i for i in range(3) if i != middle(grp)]
        assert torch.equal(batch["completion_ids"][2 * g:2 * g + 2], ro.completion_ids[[3 * g + i for i in kept]])
        assert batch["adv"][2 * g:2 * g + 2].tolist() == pytest.approx([grp[i] - statistics.median(grp) for i in kept])
    assert batch["gen_tokens"] == int(ro.completion_mask.sum()) > int(batch["completion_mask"].sum())
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}  # the exact-answer reward is what gets logged


def test_mean_baseline_is_grpo(tiny):
    """--baseline mean with the exact reward is grpo.py's rollout, advantage for advantage."""
    model, tok, task = tiny
    out = []
    for mod in (m, grpo):
        torch.manual_seed(1)
        args = mod.Args(prompts_per_step=8, group_size=4, **({"baseline": "mean"} if mod is m else {}))
        out.append(mod.rollout(model, tok, task, args, np.random.default_rng(1), torch.device("cpu")))
    assert torch.equal(out[0]["completion_ids"], out[1]["completion_ids"])
    assert torch.equal(out[0]["adv"], out[1]["adv"]) and torch.equal(out[0]["rewards"], out[1]["rewards"])


def test_train_rewards_partial_and_noise():
    scores = [(1.0, {"partial": 1.0}), (0.0, {"partial": 0.5}), (0.0, {"partial": 0.0})]
    assert m.train_rewards(scores, m.Args(task="sums", reward="partial"), None).tolist() == [1.0, 0.25, 0.0]
    assert m.train_rewards(scores, m.Args(), None).tolist() == [1.0, 0.0, 0.0]
    a = m.train_rewards(scores, m.Args(reward_noise=0.5), np.random.default_rng(7))
    b = m.train_rewards(scores, m.Args(reward_noise=0.5), np.random.default_rng(7))
    assert torch.equal(a, b) and not torch.equal(a, torch.tensor([1.0, 0.0, 0.0]))
    assert (a - torch.tensor([1.0, 0.0, 0.0])).std() > 0.1


def brute_force_flips(r, v, mu, baseline):
    flipped = zero = counted = 0
    for g in range(len(r)):
        grp = r[g]
        base = statistics.median(grp) if baseline == "median" else sum(grp) / len(grp)
        for i, x in enumerate(grp):
            if baseline == "median" and i == middle(grp):
                continue
            a, true = x - base, v[g][i] - mu[g]
            counted += 1
            flipped += a * true < 0
            zero += a == 0 and true != 0
    return {"flipped": flipped, "zero": zero, "counted": counted}


@pytest.mark.parametrize("baseline,n", [("mean", 2), ("mean", 4), ("median", 3), ("median", 5), ("median", 9)])
def test_sign_flip_counts_against_brute_force(baseline, n):
    g = torch.Generator().manual_seed(n)
    mu = torch.rand(300, generator=g)
    v = (torch.rand(300, n, generator=g) < mu[:, None]).float()  # a binary true value per response
    # graded + noisy observed rewards, on a coarse grid so that ties and exact zeros occur
    r = v + torch.round(torch.randn(300, n, generator=g) * 2) / 4
    got = m.sign_flip_counts(r, v, mu, baseline)
    assert got == brute_force_flips(r.tolist(), v.tolist(), mu.tolist(), baseline)
    assert got["flipped"] > 0 and got["counted"] == 300 * (n - (baseline == "median"))


def test_binary_rewards_with_the_mean_baseline_cannot_flip():
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(2000, generator=g)
    v = (torch.rand(2000, 4, generator=g) < mu[:, None]).float()
    assert m.sign_flip_counts(v, v, mu, "mean")["flipped"] == 0
    assert m.sign_flip_counts(torch.cat([v, v[:, :1]], 1), torch.cat([v, v[:, :1]], 1), mu, "median")["flipped"] == 0


SMALL = m.Args(steps=40, prompts_per_step=32, group_size=8, eval_every=20, eval_examples=300, pass_k=0,
               eval_hard=False, out_dir="", exp_name="t", threads=1)


def test_mc_grpo_learns(tmp_path):
    s = m.main(replace(SMALL, steps=80, eval_every=80, out_dir=str(tmp_path)))
    # stated margin: +6 points in 80 rollout batches of 32 prompts x 9 rollouts (measured, seed 0, 1 thread: 35.3 ->
    # 44.0 at 20, 39.7 at 40, 45.7 at 60, 47.3% at 80; about 45 s); a flipped advantage sign loses accuracy instead
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s


def test_partial_reward_is_the_mean_of_exact_and_partial_credit_plus_unbiased_noise():
    """--reward partial on '8+6+5:' (totals 14, 19): a right response 1, one right step of two and a wrong final
    answer (0 + 1/2) / 2, a malformed one 0; --reward-noise adds zero-mean noise of that std."""
    task = llm.make_task("sums3", 1)
    ex = task.make([8, 6, 5])
    scores = [task.verify(t, ex.answer) for t in ("8+6=14;14+5=19;=19", "8+6=14;14+5=18;=18", "nineteen")]
    args = replace(SMALL, task="sums3", digits=1, reward="partial")
    assert m.train_rewards(scores, args, np.random.default_rng(0)).tolist() == [1.0, 0.25, 0.0]
    assert m.train_rewards(scores, replace(args, reward="correct"), np.random.default_rng(0)).tolist() == [1, 0, 0]
    noisy = torch.stack([m.train_rewards(scores, replace(args, reward_noise=0.1), np.random.default_rng(s))
                         for s in range(4000)])
    assert torch.allclose(noisy.mean(0), torch.tensor([1.0, 0.25, 0.0]), atol=0.01)
    assert torch.allclose(noisy.std(0), torch.full((3,), 0.1), rtol=0.05)


@pytest.mark.parametrize("change,msg", [({"group_size": 3}, "must be even"), ({"group_size": 1}, "group-size"),
                                        ({"reward": "partial"}, "partial credit"), ({"reward_noise": -0.1}, "noise"),
                                        ({"minibatches": 3}, "must divide")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        m.main(replace(SMALL, out_dir=str(tmp_path), **change))
