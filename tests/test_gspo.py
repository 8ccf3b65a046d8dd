"""algos/gspo.py: sequence ratio, sequence clip and the loss_fn against loops; one-token responses equal GRPO."""
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
    loss, clipped = gspo.sequence_clipped_loss(logp, old, adv, mask, 0.05, 0.08)
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
    seq_loss, _ = gspo.sequence_clipped_loss(logp, old, adv, mask, 0.2, 0.28)
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
    seq_loss, _ = gspo.sequence_clipped_loss(logp, logp.detach(), adv, mask, 0.02, 0.02)
    g1, = torch.autograd.grad(seq_loss.sum() / len(adv), logp)
    tok_loss, _ = grpo.clipped_pg_loss(logp, logp.detach(), adv, 0.2, 0.2)
    g2, = torch.autograd.grad(grpo.aggregate_loss(tok_loss, mask, "seq-mean", len(adv), 0, 1), logp)
    assert torch.allclose(g1 * mask, g2 * mask, atol=1e-7)


def test_gspo_loss_is_the_step_share_of_J():
    """gspo_loss (update's loss_fn): sum_i l_i / N_seq + kl_coef * sum_it kl_it / N_tok; stats per token."""
    logp, old, adv, mask = random_batch(seed=5)
    ref = logp.detach() + torch.randn_like(old) * 0.1
    args = gspo.Args(clip_eps_low=0.05, clip_eps_high=0.08, kl_coef=0.3)
    n_seqs, n_tokens = 20, 40  # the whole mini-batch's counts, larger than this micro-batch's
    loss, stats = gspo.gspo_loss(logp, {"old": old, "adv": adv, "mask": mask, "ref": ref}, n_seqs, n_tokens, args)
    seq_loss, clipped = gspo.sequence_clipped_loss(logp, old, adv, mask, 0.05, 0.08)
    want = sum(seq_loss[i].item() for i in range(len(adv))) / n_seqs
    want += 0.3 * sum(math.exp(r - l) - (r - l) - 1 for l, r, m in
                      zip(logp.flatten().tolist(), ref.flatten().tolist(), mask.flatten().tolist()) if m) / n_tokens
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert torch.equal(stats["clipfrac"], clipped[:, None].expand_as(mask))  # each token carries its sequence's flag
    assert torch.allclose(stats["kl"], gspo.k3_kl(logp, ref))


def test_sampler_weight_is_the_geometric_mean_per_sequence():
    """When the sampler is not the trainer, l_i is weighted by (prod_t w_it)^(1/|o_i|) over the sequence's own tokens
    (padding ignored); weights of 1 leave the loss unchanged."""
    logp, old, adv, mask = random_batch(seed=7)
    args = gspo.Args(clip_eps_low=0.05, clip_eps_high=0.08)
    w = torch.rand_like(old) * 2 + 0.05
    w = w * mask + (1 - mask) * 0.0  # a zero weight on padding must not matter
    mb = {"old": old, "adv": adv, "mask": mask, "ref": None}
    plain, _ = gspo.gspo_loss(logp, mb, 20, 40, args)
    ones, _ = gspo.gspo_loss(logp, {**mb, "is_weight": torch.ones_like(old)}, 20, 40, args)
    weighted, _ = gspo.gspo_loss(logp, {**mb, "is_weight": w}, 20, 40, args)
    seq_loss, _ = gspo.sequence_clipped_loss(logp, old, adv, mask, 0.05, 0.08)
    want = 0.0
    for i in range(len(adv)):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        want += seq_loss[i].item() * math.exp(sum(math.log(w[i, t].item()) for t in toks) / len(toks))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)
    assert weighted.item() == pytest.approx(want / 20, rel=1e-5)


def test_sequence_clip_zeroes_the_whole_sequence():
    """Once s_i leaves the clip range on the side the advantage favours, no token of sequence i has gradient."""
    mask = torch.ones(2, 3)
    logp = torch.full((2, 3), 0.1, requires_grad=True)  # s = e^0.1 > 1.02
    loss, clipped = gspo.sequence_clipped_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.02, 0.02)
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


def test_logprob_mismatch_is_measured_before_any_update(tmp_path):
    """Several mini-batches and epochs: the metric is the sampler-vs-trainer gap on the sampler's weights (about 0
    on CPU, where both are the same model), not a sum over mini-batches of the policy's own drift."""
    s = gspo.main(replace(SMALL, steps=2, prompts_per_step=16, eval_every=2, eval_examples=20, ppo_epochs=2,
                          minibatches=4, micro_batch_size=16, out_dir=str(tmp_path)))
    assert s["logprob_mismatch"] < 1e-3, s  # summed over mini-batches after updates it was about 0.5


@pytest.mark.parametrize("change,msg", [
    ({"group_size": 1}, "group-size"),
    ({"minibatches": 3}, "must divide"),
    ({"clip_eps_low": 1.0}, "clip ranges"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        gspo.main(replace(SMALL, out_dir=str(tmp_path), **change))
