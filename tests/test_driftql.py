"""algos/driftql.py: drift field vs a naive double loop, its fixed point, gradient identity, learning, errors."""
import pytest
import torch

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


def test_learns_on_toy(tmp_path):
    s = driftql.main(driftql.Args(total_steps=1500, eval_every=750, out_dir=str(tmp_path)))
    assert s["score_last"] > s["score_first"] + 30, s
    assert s["goal_left"] > 0.05 and s["goal_right"] > 0.05, s  # both goals are still reached


@pytest.mark.parametrize("kw,msg", [({"reg": "l1"}, "--reg"), ({"n_gen": 1}, "--n-gen"),
                                    ({"bandwidths": (0.1, -1.0)}, "--bandwidths")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        driftql.main(driftql.Args(out_dir=str(tmp_path), **kw))
