"""algos/rollout_pruning.py: the pruning rule against a naive loop and a brute-force balance check, the quality head's
loss, training step and AUC, the features against the model's own hidden states, the survivors' prefixes and
behaviour log-probs, honest token counting, the tie to grpo.py at --oversample 1, learning, and bad input."""
import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo
from algos import rollout_pruning as rp

ADD = llm.make_task("add", 2)


# ---- the pruning rule ----
def naive_survivors(probs: list[float], keep: int) -> list[int]:
    """The floor(keep/2) lowest and ceil(keep/2) highest p, ties broken by the lower index first, as a plain loop."""
    order = sorted(range(len(probs)), key=lambda i: (probs[i], i))
    return sorted(order[:keep // 2] + order[len(probs) - (keep - keep // 2):])


@pytest.mark.parametrize("width,keep", [(16, 8), (8, 4), (9, 5), (6, 6), (4, 1)])
def test_select_survivors_against_naive_loop(width, keep):
    """Random predictions, rounded so that ties occur: the same indices as the loop, each group's ascending."""
    torch.manual_seed(width + keep)
    probs = (torch.rand(20, width) * 8).round() / 8
    got = rp.select_survivors(probs, keep, "balanced")
    assert got.shape == (20, keep)
    for g in range(20):
        assert got[g].tolist() == naive_survivors(probs[g].tolist(), keep)


@pytest.mark.parametrize("width,keep", [(8, 4), (10, 4), (8, 5), (6, 3)])
def test_survivors_are_as_balanced_as_any_subset_against_brute_force(width, keep):
    """With exact predictions (p = the final reward, 0 or 1) the survivors' number of correct rollouts is as close to
    keep/2 as that of any subset of `keep` (every subset enumerated), for every count of correct rollouts; so a group
    with both outcomes keeps both (a non-zero advantage) whenever keep >= 2."""
    for n_correct in range(width + 1):
        for trial in range(3):
            y = torch.zeros(width)
            y[torch.randperm(width, generator=torch.Generator().manual_seed(trial))[:n_correct]] = 1.0
            kept = rp.select_survivors(y[None], keep, "balanced")[0]
            got = abs(float(y[kept].sum()) - keep / 2)
            best = min(abs(sum(y[list(s)].tolist()) - keep / 2) for s in itertools.combinations(range(width), keep))
            assert got == best, (n_correct, y.tolist(), kept.tolist())
            if 0 < n_correct < width and keep >= 2:
                assert 0 < float(y[kept].sum()) < keep


def test_balanced_pruning_raises_the_group_reward_variance_against_random():
    """The mechanism: with a calibrated head (rewards drawn from the predicted p; 20,000 groups of 16, p spread by
    +-0.3 around each prompt's difficulty) balanced survivors have a larger mean group reward std and fewer
    zero-variance groups than randomly kept ones, and the inverted rule (the middle G) less than both. Measured (seed 0)
    0.407 / 0.384 / 0.362: the margins, 0.01, are eight standard errors of a mean std (0.0013) or more."""
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    base = torch.rand(20000, 1, generator=gen)  # a prompt's difficulty
    probs = (base + 0.6 * (torch.rand(20000, 16, generator=gen) - 0.5)).clamp(0, 1)
    y = torch.bernoulli(probs, generator=gen)

    def stats(keep):
        r = torch.gather(y, 1, keep)
        return float(r.std(1).mean()), float((r.std(1) == 0).float().mean())

    bal = stats(rp.select_survivors(probs, 8, "balanced"))
    rnd = stats(rp.select_survivors(probs, 8, "random", rng))
    middle = stats(torch.sort(probs, dim=1, stable=True).indices[:, 4:12])
    assert bal[0] > rnd[0] + 0.01 and bal[1] < rnd[1] - 0.02 and middle[0] < rnd[0] - 0.01, (bal, rnd, middle)


def test_random_rule_keeps_every_rollout_equally_often():
    """--prune-rule random: each of G' rollouts survives with probability G/G' (20,000 groups: the binomial std of a
    frequency is below 0.004, the bound 0.02 is five of them), whatever the predictions."""
    probs = torch.arange(16.0).repeat(20000, 1)
    keep = rp.select_survivors(probs, 8, "random", np.random.default_rng(0))
    freq = torch.bincount(keep.flatten(), minlength=16).float() / 20000
    assert torch.allclose(freq, torch.full((16,), 0.5), atol=0.02)
    assert all(len(set(row)) == 8 for row in keep[:100].tolist())


# ---- the quality head ----
def test_head_bce_loss_against_naive():
    torch.manual_seed(0)
    head = rp.QualityHead(5, 0)
    h, y = torch.randn(30, 5), torch.rand(30)
    got = rp.head_bce_loss(head, h, y)
    with torch.no_grad():
        z = (h @ head.f.weight.T + head.f.bias).squeeze(-1)
    want = -sum(float(y[i]) * math.log(1 / (1 + math.exp(-float(z[i])))) +
                (1 - float(y[i])) * math.log(1 - 1 / (1 + math.exp(-float(z[i])))) for i in range(30)) / 30
    assert float(got.detach()) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("hidden", [0, 16])
def test_train_head_learns_a_separable_toy(hidden):
    """Two Gaussian clouds separated along one direction: train_head's loss falls (before > after, and far below log 2)
    and its AUC on fresh points from the same clouds is near 1."""
    torch.manual_seed(0)
    w = torch.randn(12)
    w = w / w.norm()

    def points(n):
        y = (torch.rand(n) < 0.5).float()
        return torch.randn(n, 12) + 3 * (2 * y[:, None] - 1) * w, y

    head = rp.QualityHead(12, hidden)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    h, y = points(256)
    first, last = rp.train_head(head, opt, h, y, 200)
    assert last < first and last < 0.2, (first, last)
    h2, y2 = points(256)
    with torch.no_grad():
        assert rp.head_auc(torch.sigmoid(head(h2)), y2) > 0.97


def test_head_auc_against_naive_pairs():
    torch.manual_seed(0)
    p, y = (torch.rand(40) * 5).round() / 5, (torch.rand(40) < 0.4).float()
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a, ya in zip(p.tolist(), y.tolist())
             for b, yb in zip(p.tolist(), y.tolist()) if ya == 1 and yb == 0]
    assert rp.head_auc(p, y) == pytest.approx(sum(pairs) / len(pairs))
    assert math.isnan(rp.head_auc(p, torch.ones(40)))


# ---- the partial rollouts, their features and the survivors ----
def test_prefix_features_match_the_models_hidden_state():
    """h_i is the final-norm hidden state of the prefix's last real token (EOS included), as the model's own forward
    with output_hidden_states gives it, for left-padded prompts and right-padded prefixes of different lengths."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    prompts = common.encode_prompts(tok, ["12+3=", "7+85=", "40+40="])
    ro = common.generate(model, tok, prompts, 2, 3)
    got = rp.prefix_features(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, micro=4)
    for i in range(len(ro.texts)):
        p = ro.prompt_ids[i][ro.prompt_mask[i].bool()]
        c = ro.completion_ids[i][ro.completion_mask[i].bool()]
        with torch.no_grad():
            out = model(input_ids=torch.cat([p, c])[None], output_hidden_states=True)
        # padded batch against one unpadded sequence: fp32 attention over other shapes, measured up to 1e-5 on
        # PyTorch's AVX2 kernels (hidden states of size ~2.5); the wrong position would be off by ~1
        assert torch.allclose(got[i], out.hidden_states[-1][0, -1], atol=1e-4)


class FixedHead(torch.nn.Module):
    """A head that ignores the features: logits given per row of the batch (the predictions are known in advance)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, h):
        return self.logits[:h.shape[0]]


def pruned_batch(monkeypatch, prune_at=2, max_new=8, seed=0):
    """pruned_rollout (which calls finish_survivors on the picks) with a FixedHead, every generate call recorded."""
    torch.manual_seed(seed)
    model, tok = common.load_model("tiny-0.6m")
    args = rp.Args(prompts_per_step=6, group_size=4, oversample=2, prune_at=prune_at, max_new_tokens=max_new)
    calls, real = [], common.generate
    monkeypatch.setattr(common, "generate", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    prompts = common.encode_prompts(tok, [e.prompt for e in ADD.sample("train", 6, np.random.default_rng(seed))])
    logits = torch.randn(6 * 8, generator=torch.Generator().manual_seed(seed))
    ro, feats, stats = rp.pruned_rollout(common.Sampler(model), tok, prompts, FixedHead(logits), args,
                                         np.random.default_rng(seed))
    return model, tok, args, ro, feats, stats, calls, logits


def test_survivors_are_the_rules_picks_with_their_prefix_kept(monkeypatch):
    """The rows that survive are select_survivors' picks from the head's predictions; each survivor starts with its
    partial rollout token for token (behaviour log-probs too) and stays within the budget."""
    model, tok, args, ro, feats, stats, calls, logits = pruned_batch(monkeypatch)
    pre = calls[0]
    keep = rp.select_survivors(torch.sigmoid(logits).view(6, 8), 4)
    rows = (torch.arange(6)[:, None] * 8 + keep).flatten()
    assert ro.completion_ids.shape[0] == 24 and feats.shape[0] == 24
    for j, i in enumerate(rows.tolist()):
        n = int(pre.completion_mask[i].sum())
        assert torch.equal(ro.completion_ids[j, :n], pre.completion_ids[i, :n])
        assert torch.equal(ro.logprobs[j, :n], pre.logprobs[i, :n])
        assert torch.equal(ro.prompt_ids[j], pre.prompt_ids[i])
        assert int(ro.completion_mask[j].sum()) <= args.max_new_tokens
    assert stats["pred_kept"] == pytest.approx(float(torch.sigmoid(logits)[rows].mean()), rel=1e-6)
    out = rp.finish_survivors(common.Sampler(model), tok, pre, [5, 0, 3], args)  # any rows, in the order given
    for j, i in enumerate([5, 0, 3]):
        n = int(pre.completion_mask[i].sum())
        assert torch.equal(out.completion_ids[j, :n], pre.completion_ids[i, :n])
        assert (out.finish_reasons[j] == "stop") == bool((out.completion_ids[j] == tok.eos_token_id).any())


def test_token_count_matches_every_generated_token(monkeypatch):
    """Honest counting: the survivors' tokens plus the pruned prefixes' (stats['pruned_tokens']) are exactly the tokens
    of every generate call (all G' partial rollouts, then the continuations)."""
    model, tok, args, ro, feats, stats, calls, logits = pruned_batch(monkeypatch)
    generated = sum(int(c.completion_mask.sum()) for c in calls)
    assert len(calls) == 2 and int(ro.completion_mask.sum()) + stats["pruned_tokens"] == generated
    assert stats["pruned_tokens"] > 0


def test_survivors_logprobs_match_the_policy(monkeypatch):
    """Prefix and continuation are one on-policy sample: the concatenated behaviour log-probs equal the trainer's
    per-token log-probs of the whole completion (fp32 on CPU, one sampler: equal up to summation order, 1e-4)."""
    model, tok, args, ro, feats, stats, calls, logits = pruned_batch(monkeypatch, prune_at=1)
    with torch.no_grad():
        lp = common.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    assert torch.allclose(lp, ro.logprobs, atol=1e-4)


# ---- the loop ----
SMALL = rp.Args(steps=30, prompts_per_step=32, group_size=8, eval_every=30, eval_examples=200, pass_k=0,
                eval_hard=False, out_dir="", exp_name="t", threads=1)


def rows(path):
    return {r["step"]: r for r in map(json.loads, open(path))}


def test_oversample_one_equals_grpo(tmp_path):
    """--oversample 1: no head, no pruning, grpo.py's rollout and update, metric for metric."""
    cfg = dict(steps=2, eval_every=2, eval_examples=40, prompts_per_step=8, out_dir=str(tmp_path))
    s = rp.main(replace(SMALL, oversample=1, exp_name="s", **cfg))
    g = grpo.main(grpo.Args(group_size=8, pass_k=0, eval_hard=False, exp_name="g", threads=1, **cfg))
    for k in ("eval_acc_end", "train_reward_last", "gen_tokens", "zero_var_group_frac"):
        assert s[k] == g[k], k
    a, b = rows(tmp_path / "s" / "metrics.jsonl"), rows(tmp_path / "g" / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rollout/reward", "rollout/length", "loss/pg", "loss/clipfrac", "loss/grad_norm", "loss/entropy"):
            assert a[step][key] == b[step][key], (step, key)
    assert s["pruned_tokens"] == 0 and math.isnan(s["head_auc"])


def test_rollout_pruning_learns(tmp_path):
    """30 rollout batches of 32 prompts (G' = 16 partial rollouts pruned to G = 8 at t = 1): held-out greedy accuracy
    on 2-digit addition rises by at least 6 points (measured, seed 0, one thread: 33.5 -> 47.5), the head ranks fresh
    survivors better than chance on average, and gen_tokens counts the pruned prefixes."""
    s = rp.main(replace(SMALL, out_dir=str(tmp_path)))
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s
    assert s["head_auc"] > 0.52, s
    hist = rows(tmp_path / "t" / "metrics.jsonl")
    survivors = sum(hist[t]["rollout/length"] * 32 * 8 for t in range(1, 31))
    assert s["gen_tokens"] == pytest.approx(survivors + s["pruned_tokens"], abs=1) and s["pruned_tokens"] > 0


# ---- bad input ----
@pytest.mark.parametrize("change,msg", [
    ({"oversample": 0}, "oversample"),
    ({"prune_at": 0}, "prune-at"),
    ({"prune_at": 8}, "prune-at"),
    ({"head_lr": 0.0}, "head"),
    ({"head_steps": -1}, "head"),
    ({"oversample": 1, "prune_rule": "random"}, "prune-rule"),
    ({"group_size": 1}, "group-size"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        rp.main(replace(SMALL, out_dir=str(tmp_path), **change))


def test_select_survivors_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="cannot keep"):
        rp.select_survivors(torch.rand(2, 4), 5)
    with pytest.raises(ValueError, match="unknown pruning rule"):
        rp.select_survivors(torch.rand(2, 4), 2, "best")
