"""worldmodels/policy_eval.py: MMRV (hand-worked and naive loop), Pearson, expected action, learning, bad input."""
import json

import numpy as np
import pytest
import torch

from worldmodels import policy_eval as pe
from worldmodels._envs import MOVES, EnvConfig, agent_cells


def test_mmrv_hand_worked():
    # real R = .9, .5, .1; imagined S = .4, .6, .1. Only the pair (0, 1) is flipped: |.9 - .5| = .4.
    # max over j per policy: .4, .4, 0  ->  MMRV = .8 / 3
    assert pe.mmrv([0.9, 0.5, 0.1], [0.4, 0.6, 0.1]) == pytest.approx(0.8 / 3)
    assert pe.mmrv([0.9, 0.5, 0.1], [0.8, 0.3, 0.0]) == 0.0  # same order: no violation
    assert pe.mmrv([0.9, 0.1], [0.1, 0.9]) == pytest.approx(0.8)


def test_mmrv_matches_naive_loop():
    rng = np.random.default_rng(0)
    r, s = rng.random(7), rng.random(7)
    naive = np.mean([max(abs(r[i] - r[j]) * ((s[i] < s[j]) != (r[i] < r[j])) for j in range(7)) for i in range(7)])
    assert pe.mmrv(r, s) == pytest.approx(naive)


def test_pearson():
    rng = np.random.default_rng(1)
    a, b = rng.random(7), rng.random(7)
    assert pe.pearson(a, b) == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert np.isnan(pe.pearson([1, 1, 1], [0, 1, 2]))


def test_expected_action_is_noop_into_walls():
    walls = np.zeros((2, 5, 5), bool)
    walls[:, 0, :] = True
    cells = np.array([[1, 2], [2, 2]])
    np.testing.assert_array_equal(pe.expected_action(walls, cells, np.array([0, 0])), [4, 0])


def test_shapes_and_losses():
    torch.manual_seed(0)
    m = pe.WorldModel(channels=8)
    x, y, a = torch.rand(4, 3, 10, 10), torch.rand(4, 3, 10, 10), torch.randint(0, 5, (4,))
    loss, logits = pe.forward_loss(m, x, a, y)
    assert logits.shape == (4, 3, 10, 10) and loss.ndim == 0
    assert m.inverse(x, y).shape == (4, 5)
    pe.inverse_loss(m, x, a, torch.sigmoid(logits)).backward()
    assert m.f[0].weight.grad is not None  # the consistency term reaches the forward model


def test_consistency_term_holds_g_fixed():
    """Eq. (3) as the default trains it: the gradient reaches f only, with the value inverse_loss gives; the
    --no-frozen-g form (inverse_loss on the predicted frame) trains g too."""
    torch.manual_seed(0)
    m = pe.WorldModel(channels=8, action_gate=True)
    x, y, a = torch.rand(4, 3, 10, 10), torch.rand(4, 3, 10, 10), torch.randint(0, 5, (4,))
    _, logits = pe.forward_loss(m, x, a, y)
    lc = pe.consistency_loss(m, x, a, torch.sigmoid(logits))
    torch.testing.assert_close(lc, pe.inverse_loss(m, x, a, torch.sigmoid(logits)))
    lc.backward()
    assert all(p.grad is None for p in m.g.parameters()), "g must get no gradient from eq. (3)"
    assert m.f[0].weight.grad is not None and m.f[0].weight.grad.abs().sum() > 0
    m.zero_grad(set_to_none=True)
    pe.inverse_loss(m, x, a, torch.sigmoid(pe.forward_loss(m, x, a, y)[1])).backward()
    assert all(p.grad is not None for p in m.g.parameters())


class TrueModel(pe.WorldModel):
    """The true dynamics as a 'world model': next-frame logits +-20 and the inverse from the agent's move."""

    def forward(self, x, a):
        f = x.numpy()
        cells = agent_cells(f, EnvConfig())
        tgt = cells + MOVES[a.numpy()]
        blocked = f[np.arange(len(f)), 0, tgt[:, 0], tgt[:, 1]] > 0.5
        new = np.where(blocked[:, None], cells, tgt)
        out = f.copy()
        out[:, 2] = 0
        out[np.arange(len(f)), 2, new[:, 0], new[:, 1]] = 1
        return torch.from_numpy(out * 40 - 20)

    def inverse(self, x, x_next):
        d = agent_cells(x_next.numpy(), EnvConfig()) - agent_cells(x.numpy(), EnvConfig())
        act = np.array([next(i for i in range(5) if (MOVES[i] == v).all()) for v in d])
        return torch.nn.functional.one_hot(torch.from_numpy(act), 5).float() * 20


def test_true_dynamics_reproduce_real_success():
    """With a perfect model, imagined episodes are the real ones: r = 1, MMRV = 0, nothing terminated."""
    cfg, model = EnvConfig(), TrueModel(channels=4)
    real, imag = [], []
    for i, eps in enumerate((0.0, 0.3, 0.6, 1.0)):
        r, frames, effs = pe.run_real(cfg, eps, 100, 10, seed=i)
        s, term, _ = pe.run_imagined(model, cfg, eps, 100, 10, seed=i, thr=0.5)
        np.testing.assert_array_equal(r, s)
        assert not term.any()
        chk = pe.next_state_check(model, cfg, frames, effs)
        assert chk["one_step_agent_acc"] == 1.0 and chk["open_loop_agent_acc"].min() == 1.0
        real.append(r.mean()), imag.append(s.mean())
    assert pe.pearson(imag, real) == pytest.approx(1.0) and pe.mmrv(real, imag) == 0.0


def test_policy_kinds_reduce_to_shortest_path_and_stand_still():
    """detour=0, near=D beyond the map and stall=0 walk the shortest path exactly as eps=0 does; stall=1 never
    moves; a mixed set is read and checked."""
    cfg = EnvConfig()
    ref, frames, _ = pe.run_real(cfg, "0", 50, 8, seed=3)
    for spec in ("detour=0", "near=99", "stall=0", "eps=0"):
        s, f, _ = pe.run_real(cfg, spec, 50, 8, seed=3)
        np.testing.assert_array_equal(s, ref), np.testing.assert_array_equal(f, frames)
    s, f, effs = pe.run_real(cfg, "stall=1", 50, 8, seed=3)
    assert (effs == 4).all() and not s.any()
    s, _, _ = pe.run_real(cfg, "detour=8", 200, 8, seed=3)
    assert s.mean() < ref.mean() - 0.2  # eight steps towards the decoy cost the short episodes
    assert pe.parse_policy("near=3") == ("near", 3.0) and pe.parse_policy(0.35) == ("eps", 0.35)
    pe.check_args(pe.Args(policies=("0", "detour=6", "near=2", "stall=0.5")))


def test_true_dynamics_reproduce_real_success_for_every_kind():
    cfg, model = EnvConfig(), TrueModel(channels=4)
    for i, spec in enumerate(("detour=5", "near=2", "stall=0.5")):
        r, _, _ = pe.run_real(cfg, spec, 100, 10, seed=i)
        s, term, _ = pe.run_imagined(model, cfg, spec, 100, 10, seed=i, thr=0.5)
        np.testing.assert_array_equal(r, s)
        assert not term.any()


def test_training_reduces_losses(tmp_path):
    pe.main(pe.Args(steps=60, train_traj=100, episodes=10, policies=(0.0, 1.0), horizon=4, log_every=59,
                    out_dir=str(tmp_path)))
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss/forward" in r]
    assert train[-1]["loss/forward"] < 0.5 * train[0]["loss/forward"]
    assert train[-1]["loss/inverse"] < train[0]["loss/inverse"]
    assert (tmp_path / "policy_eval.png").exists() and (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("kw,msg", [({"policies": (0.5,)}, "policies"), ({"policies": (0.0, 1.5)}, "policies"),
                                    ({"train_eps": 2.0}, "train-eps"), ({"term_threshold": 1.0}, "term-threshold"),
                                    ({"episodes": 1}, "episodes"), ({"policies": ("0", "warp=2")}, "warp"),
                                    ({"policies": ("0", "near=1.5")}, "near"), ({"policies": ("0", "stall=2")}, "stall")])
def test_bad_args(kw, msg):
    with pytest.raises(SystemExit, match=msg):
        pe.check_args(pe.Args(**kw))
