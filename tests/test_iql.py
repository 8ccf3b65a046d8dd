"""algos/iql.py: expectile, value, Q and AWR losses against naive loops; learns on pendulum-medium; clear errors."""
import pytest
import torch

from algos import _offline_data as D
from algos import iql


def test_expectile_loss_matches_naive_loop():
    torch.manual_seed(0)
    diff = torch.randn(50)
    for tau in (0.5, 0.7, 0.9):
        naive = sum((tau if u >= 0 else 1 - tau) * u * u for u in diff.tolist()) / len(diff)
        assert iql.expectile_loss(diff, tau).item() == pytest.approx(naive, rel=1e-5)
    # tau = 0.5 is half the mean squared error; large tau pushes V towards the upper expectile
    assert iql.expectile_loss(diff, 0.5).item() == pytest.approx(0.5 * (diff ** 2).mean().item(), rel=1e-6)


def test_expectile_fit_approaches_max_as_tau_grows():
    q = torch.tensor([0.0, 1.0, 2.0, 10.0])
    fits = []
    for tau in (0.5, 0.9, 0.99):
        v = torch.zeros((), requires_grad=True)
        opt = torch.optim.Adam([v], lr=0.1)
        for _ in range(1500):
            opt.zero_grad()
            iql.expectile_loss(q - v, tau).backward()
            opt.step()
        fits.append(v.item())
    assert fits[0] == pytest.approx(q.mean().item(), abs=0.05) and fits[0] < fits[1] < fits[2] < 10


def test_awr_loss_matches_naive_loop():
    torch.manual_seed(0)
    actor = D.Actor(3, 2, 16)
    s, a, adv = torch.randn(20, 3), torch.rand(20, 2) * 2 - 1, torch.randn(20) * 3
    pi = actor(s).detach()
    naive = sum(min(float(torch.exp(3.0 * adv[i])), 5.0) * float(((pi[i] - a[i]) ** 2).sum())
                for i in range(20)) / 20
    assert iql.awr_loss(actor, s, a, adv, beta=3.0, max_weight=5.0).item() == pytest.approx(naive, rel=1e-5)



def test_q_loss_matches_naive_loop():
    """Eq. (6) per sample: (Q_i(s, a) - (r + gamma (1 - d) V(s')))^2 for both heads, each averaged, then summed.
    Catches: a missing or inverted (1 - d) mask (half the rows are terminal), a wrong discount, V(s) instead of
    V(s'), one head only or the min of the heads, and a target that is not detached (V would get gradients)."""
    torch.manual_seed(0)
    critic, vf = D.Critic(3, 1, 16), D.mlp(3, 1, 16)
    s, a, s2 = torch.randn(12, 3), torch.rand(12, 1) * 2 - 1, torch.randn(12, 3)
    r, d, gamma = torch.randn(12), (torch.arange(12) % 2).float(), 0.9
    loss, q1 = iql.q_loss(critic, vf, s, a, r, s2, d, gamma)
    naive = 0.0
    for i in range(12):
        y = r[i].item() + gamma * (1 - d[i].item()) * vf(s2[i:i + 1]).item()
        qa, qb = critic(s[i:i + 1], a[i:i + 1])
        naive += ((qa.item() - y) ** 2 + (qb.item() - y) ** 2) / 12
    assert loss.item() == pytest.approx(naive, rel=1e-5)
    torch.testing.assert_close(q1, critic(s, a)[0])
    loss.backward()
    assert all(p.grad is None for p in vf.parameters())  # the TD target is a constant
    assert all(p.grad is not None for p in critic.parameters())


def test_value_loss_matches_naive_loop():
    """Eq. (5) per sample: |tau - 1(u < 0)| u^2 with u = min(Q'_1, Q'_2)(s, a) - V(s), averaged; the returned
    advantage is u. Catches: max (or one head) instead of the min of the target heads (the two random heads
    differ on every row), V - Q instead of Q - V (with tau = 0.8 the asymmetric weight changes the value), and a
    target critic that is not detached."""
    torch.manual_seed(1)
    critic_t, vf = D.Critic(3, 1, 16), D.mlp(3, 1, 16)
    s, a, tau = torch.randn(16, 3), torch.rand(16, 1) * 2 - 1, 0.8
    with torch.no_grad():  # centre V on the targets, so that u takes both signs
        vf[-1].bias -= (vf(s).squeeze(-1) - torch.min(*critic_t(s, a))).median() + 1e-3
    loss, adv = iql.value_loss(vf, critic_t, s, a, tau)
    naive, us = 0.0, []
    for i in range(16):
        qa, qb = critic_t(s[i:i + 1], a[i:i + 1])
        u = min(qa.item(), qb.item()) - vf(s[i:i + 1]).item()
        us.append(u)
        naive += (tau if u >= 0 else 1 - tau) * u * u / 16
    assert loss.item() == pytest.approx(naive, rel=1e-5)
    assert adv.tolist() == pytest.approx(us, abs=1e-6)
    assert any(u > 0 for u in us) and any(u < 0 for u in us)  # both branches of the expectile weight are used
    q1, q2 = critic_t(s, a)
    assert (q1 - q2).abs().min() > 1e-4  # min and max differ on every row
    loss.backward()
    assert all(p.grad is None for p in critic_t.parameters())

def test_learns_on_pendulum_medium(tmp_path):
    s = iql.main(iql.Args(total_steps=2000, eval_every=1000, out_dir=str(tmp_path)))
    assert s["score_last"] > s["score_first"] + 30, s


@pytest.mark.parametrize("kw,msg", [({"expectile": 1.0}, "--expectile"), ({"beta": -1.0}, "--beta"),
                                    ({"rho": 2.0}, "--rho")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        iql.main(iql.Args(out_dir=str(tmp_path), **kw))
