"""algos/iql.py: expectile and AWR losses against naive loops; learns on pendulum-medium; clear errors."""
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


def test_learns_on_pendulum_medium(tmp_path):
    s = iql.main(iql.Args(total_steps=2000, eval_every=1000, out_dir=str(tmp_path)))
    assert s["score_last"] > s["score_first"] + 30, s


@pytest.mark.parametrize("kw,msg", [({"expectile": 1.0}, "--expectile"), ({"beta": -1.0}, "--beta"),
                                    ({"rho": 2.0}, "--rho")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        iql.main(iql.Args(out_dir=str(tmp_path), **kw))
