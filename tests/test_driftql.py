"""algos/driftql.py: drift field vs a naive double loop, its fixed point, gradient identity, learning, errors."""
import pytest
import torch

from algos import _offline_data as D
from algos import driftql

BW = (0.1, 0.5)


def naive_field(x, y, bws):
    b, m, _ = x.shape
    out = torch.zeros_like(x)
    k = lambda u, v: sum(torch.exp(-((u - v) ** 2).sum() / (2 * h * h)) / (h * h) for h in bws)
    for i in range(b):
        for p in range(m):
            att = sum(k(x[i, p], y[i, q]) * (y[i, q] - x[i, p]) for q in range(y.shape[1])) / y.shape[1]
            rep = sum(k(x[i, p], x[i, j]) * (x[i, j] - x[i, p]) for j in range(m) if j != p) / (m - 1)
            out[i, p] = att - rep
    return out


def test_drift_field_matches_naive_double_loop():
    torch.manual_seed(0)
    x, y = torch.randn(3, 5, 2) * 0.5, torch.randn(3, 4, 2) * 0.5
    torch.testing.assert_close(driftql.drift_field(x, y, BW), naive_field(x, y, BW), rtol=1e-5, atol=1e-6)


def test_attraction_and_repulsion_directions():
    x = torch.tensor([[[0.0, 0.0], [0.2, 0.0]]])
    y = torch.tensor([[[1.0, 0.0]]])
    v = driftql.drift_field(x, y, (0.5,))
    # x0 is pulled right by y but pushed left by x1 (close, so repulsion wins); x1 is pushed right by both
    assert v[0, 0, 0] < 0 < v[0, 1, 0]
    assert torch.allclose(v[..., 1], torch.zeros(1, 2))


def test_field_vanishes_when_generated_equals_data():
    # the attraction to a set equals the repulsion from the same set (same kernel, same normalisation)
    torch.manual_seed(1)
    x = torch.randn(2, 6, 2)
    others = [torch.cat([x[:, :i], x[:, i + 1:]], 1) for i in range(6)]
    v = torch.stack([driftql.drift_field(torch.cat([x[:, i:i + 1], o], 1), o, BW)[:, 0] for i, o in
                     enumerate(others)], 1)
    # with y = the other generated samples, attraction (mean over 5) == repulsion (sum over 5 / 5)
    torch.testing.assert_close(v, torch.zeros_like(v), atol=1e-5, rtol=0)


def test_drift_loss_gradient_is_minus_field():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 2, requires_grad=True)
    y = torch.randn(4, 1, 2)
    (g,) = torch.autograd.grad(driftql.drift_loss(x, y, BW), x)
    v = driftql.drift_field(x.detach(), y, BW)
    torch.testing.assert_close(g, -2 * v / (4 * 3), rtol=1e-5, atol=1e-7)


def test_mse_variant_is_td3_bc_regulariser():
    x, y = torch.randn(5, 3, 2), torch.randn(5, 1, 2)
    naive = sum(((x[b, m] - y[b, 0]) ** 2).sum() for b in range(5) for m in range(3)) / 15
    torch.testing.assert_close(driftql.mse_bc_loss(x, y), naive)



@pytest.mark.parametrize("reg", ["drift", "mse"])
def test_actor_loss_matches_naive_loop(reg):
    """L_pi = -lambda mean_i Q_1(s_i, pi(s_i, z_i0)) + L_reg, lambda = alpha / mean_i |Q_1| as a constant, with the
    M generated actions of each state drawn from the same noise. The regulariser is rebuilt per sample: mean over
    (i, m) of ||V(x_im)||^2 (naive_field) for drift, of ||x_im - a_i||^2 for mse. Catches: +Q instead of -Q, Q_2
    or min(Q_1, Q_2) instead of Q_1, lambda dividing by mean Q instead of mean |Q| (Q takes both signs here), the
    wrong regulariser for --reg, and an undetached lambda (the gradients are compared too)."""
    torch.manual_seed(0)
    gen, critic = driftql.Generator(3, 2, 16), D.Critic(3, 2, 16)
    s, a = torch.randn(6, 3), torch.rand(6, 2) * 2 - 1
    with torch.no_grad():  # move Q_2 into Q_1's range, so that min(Q_1, Q_2) differs from Q_1 on some rows
        critic.q2[-1].bias -= 0.15
    args = driftql.Args(reg=reg, n_gen=4, bandwidths=BW, alpha=2.5)
    torch.manual_seed(7)
    loss, reg_val = driftql.actor_loss(gen, critic, s, a, args)
    g_got = torch.autograd.grad(loss, list(gen.parameters()))
    torch.manual_seed(7)  # the same noise z, drawn by the same call
    x = gen(s.unsqueeze(1).expand(6, 4, -1))
    q = torch.stack([critic(s[i:i + 1], x[i:i + 1, 0])[0][0] for i in range(6)])
    assert q.min() < 0 < q.max()  # so mean |Q| differs from |mean Q|
    q2 = critic(s, x[:, 0])[1]
    assert (q2 < q).any() and (q2 > q).any()  # Q_1 is neither the min nor the max of the heads
    lmbda = 2.5 / (sum(abs(v) for v in q.tolist()) / 6)
    if reg == "drift":
        v = naive_field(x.detach(), a.unsqueeze(1), BW)
        # ||x - stopgrad(x + V)||^2 has the value ||V||^2 and the gradient -2 V . dx
        naive_reg = sum((v[i, m] ** 2).sum() - 2 * (v[i, m] * (x[i, m] - x[i, m].detach())).sum()
                        for i in range(6) for m in range(4)) / 24
    else:
        naive_reg = sum(((x[i, m] - a[i]) ** 2).sum() for i in range(6) for m in range(4)) / 24
    naive = -lmbda * sum(q[i] for i in range(6)) / 6 + naive_reg
    assert loss.item() == pytest.approx(naive.item(), rel=1e-5, abs=1e-6)
    assert reg_val.item() == pytest.approx(naive_reg.item(), rel=1e-5, abs=1e-7)
    g_naive = torch.autograd.grad(naive, list(gen.parameters()))
    for g1, g2 in zip(g_got, g_naive):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_critic_loss_matches_naive_loop():
    """The TD3 target per sample: y_i = r_i + gamma (1 - d_i) min(Q'_1, Q'_2)(s'_i, clip(pi'(s'_i) + clip(eps_i))),
    L = mean (Q_1 - y)^2 + mean (Q_2 - y)^2, with the same smoothing noise. Catches: max instead of min of the
    target heads, the online critic in the target, a missing (1 - d) mask (half the rows are terminal), an
    unclipped smoothing noise (noise_clip 0.05 against std 0.5 clips most of it), and a wrong discount."""
    torch.manual_seed(0)
    critic, critic_t, actor_t = D.Critic(3, 2, 16), D.Critic(3, 2, 16), D.Actor(3, 2, 16)
    s, a, s2 = torch.randn(10, 3), torch.rand(10, 2) * 2 - 1, torch.randn(10, 3)
    r, d, gamma = torch.randn(10), (torch.arange(10) % 2).float(), 0.95
    torch.manual_seed(3)
    loss, q1 = driftql.critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, gamma, 0.5, 0.05)
    torch.manual_seed(3)
    eps = torch.randn_like(a) * 0.5
    naive = 0.0
    for i in range(10):
        a2 = (actor_t(s2[i:i + 1]) + eps[i].clamp(-0.05, 0.05)).clamp(-1, 1)
        qa_t, qb_t = critic_t(s2[i:i + 1], a2)
        y = r[i].item() + gamma * (1 - d[i].item()) * min(qa_t.item(), qb_t.item())
        qa, qb = critic(s[i:i + 1], a[i:i + 1])
        naive += ((qa.item() - y) ** 2 + (qb.item() - y) ** 2) / 10
    assert loss.item() == pytest.approx(naive, rel=1e-5)
    torch.testing.assert_close(q1, critic(s, a)[0])

def test_learns_on_toy(tmp_path):
    s = driftql.main(driftql.Args(total_steps=1500, eval_every=750, out_dir=str(tmp_path)))
    assert s["score_last"] > s["score_first"] + 30, s
    assert s["goal_left"] > 0.05 and s["goal_right"] > 0.05, s  # both goals are still reached


@pytest.mark.parametrize("kw,msg", [({"reg": "l1"}, "--reg"), ({"n_gen": 1}, "--n-gen"),
                                    ({"bandwidths": (0.1, -1.0)}, "--bandwidths")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        driftql.main(driftql.Args(out_dir=str(tmp_path), **kw))
