"""algos/gspo.py: sequence ratio and sequence clip against loops; one-token responses equal token-level GRPO."""
import math
from dataclasses import replace

import pytest
import torch

from algos import grpo, gspo


def random_batch(B=8, C=6, seed=0):
    torch.manual_seed(seed)
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (B,))[:, None]).float()
    logp = (torch.randn(B, C) * 0.1).requires_grad_()
    old = logp.detach() + torch.randn(B, C) * 0.1
    return logp, old, torch.randn(B), mask


def test_sequence_ratio_and_loss_against_loop():
    logp, old, adv, mask = random_batch()
    loss, clipped = gspo.gspo_loss(logp, old, adv, mask, 0.05, 0.08)
    for i in range(len(adv)):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in toks) / len(toks))
        assert gspo.sequence_ratio(logp, old, mask)[i].item() == pytest.approx(s, rel=1e-5)
        a = adv[i].item()
        want = -min(s * a, min(max(s, 0.95), 1.08) * a)
        assert loss[i].item() == pytest.approx(want, abs=1e-6)
        assert clipped[i].item() == float(min(max(s, 0.95), 1.08) * a < s * a)


def test_padding_does_not_change_the_ratio():
    logp, old, adv, mask = random_batch()
    noisy = logp.detach() + (1 - mask) * 5.0  # garbage on padded positions
    assert torch.allclose(gspo.sequence_ratio(noisy, old, mask), gspo.sequence_ratio(logp, old, mask))


def test_one_token_responses_equal_token_level_grpo():
    logp, old, adv, _ = random_batch(B=10, C=1)
    mask = torch.ones(10, 1)
    seq_loss, _ = gspo.gspo_loss(logp, old, adv, mask, 0.2, 0.28)
    j_gspo = seq_loss.sum() / 10
    tok_loss, _ = grpo.clipped_pg_loss(logp, old, adv, 0.2, 0.28)
    for agg in ("seq-mean", "token-mean"):
        j_grpo = grpo.aggregate_loss(tok_loss, mask, agg, 10, 10, 1)
        assert torch.allclose(j_gspo, j_grpo, atol=1e-7)
        g1, = torch.autograd.grad(j_gspo, logp, retain_graph=True)
        g2, = torch.autograd.grad(j_grpo, logp, retain_graph=True)
        assert torch.allclose(g1, g2, atol=1e-7)


def test_on_policy_gradient_equals_grpo_seq_mean():
    """ratio 1 (pi_old = pi_theta): GSPO's gradient is GRPO's with --loss-agg seq-mean, for any lengths."""
    logp, _, adv, mask = random_batch(seed=3)
    seq_loss, _ = gspo.gspo_loss(logp, logp.detach(), adv, mask, 0.02, 0.02)
    g1, = torch.autograd.grad(seq_loss.sum() / len(adv), logp)
    tok_loss, _ = grpo.clipped_pg_loss(logp, logp.detach(), adv, 0.2, 0.2)
    g2, = torch.autograd.grad(grpo.aggregate_loss(tok_loss, mask, "seq-mean", len(adv), 0, 1), logp)
    assert torch.allclose(g1 * mask, g2 * mask, atol=1e-7)


def test_sequence_clip_zeroes_the_whole_sequence():
    """Once s_i leaves the clip range on the side the advantage favours, no token of sequence i has gradient."""
    mask = torch.ones(2, 3)
    logp = torch.full((2, 3), 0.1, requires_grad=True)  # s = e^0.1 > 1.02
    loss, clipped = gspo.gspo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.02, 0.02)
    g, = torch.autograd.grad(loss.sum(), logp)
    assert clipped.tolist() == [1.0, 0.0] and torch.all(g[0] == 0) and torch.all(g[1] != 0)


SMALL = gspo.Args(steps=40, prompts_per_step=32, group_size=8, eval_every=20, eval_examples=300, pass_k=0,
                  eval_hard=False, out_dir="", exp_name="t", threads=1)


def test_gspo_learns(tmp_path):
    s = gspo.main(replace(SMALL, out_dir=str(tmp_path)))
    # stated margin: +6 points in 40 rollout batches (measured, seed 0, 1 thread: +15; the comparison gained
    # 11.0 +- 2.2 over 3 seeds; a flipped sign loses accuracy instead)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s
    assert (tmp_path / "t" / "curve.png").exists()


@pytest.mark.parametrize("change,msg", [
    ({"group_size": 1}, "group-size"),
    ({"minibatches": 3}, "must divide"),
    ({"clip_eps_low": 1.0}, "clip ranges"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        gspo.main(replace(SMALL, out_dir=str(tmp_path), **change))
