"""algos/ravl.py: edge-of-reach detection, zero uncertainty of the true model, ensemble maths, learning, errors."""
import numpy as np
import pytest
import torch

from algos import _offline_data as D
from algos import ravl


def test_edge_of_reach_on_hand_built_rollout():
    # two rollouts of k = 3 from s0 and u0: s0 -> s1 -> s2 -> s3 and u0 -> u1 -> (terminal) u2
    s = [np.array([i, 0.0, 0.0], np.float32) for i in range(4)]
    u = [np.array([0.0, i + 10.0, 0.0], np.float32) for i in range(3)]
    obs = np.stack([s[0], u[0], s[1], u[1], s[2]])
    nxt = np.stack([s[1], u[1], s[2], u[2], s[3]])
    term = np.array([0, 0, 0, 1, 0])
    mask = ravl.edge_of_reach_mask(obs, nxt, term)
    # s3 is reached but never a start state -> edge; u2 is terminal -> never bootstrapped, not an edge
    assert mask.tolist() == [False, False, False, False, True]


def test_true_model_rollout_edges_are_the_last_step():
    rng = np.random.default_rng(0)
    policy = lambda o: np.tanh(o[:, :1])
    policy.act_dim = 1
    start = D.generate("pendulum-random", n_episodes=2)["observations"][:20]
    ro = ravl.model_rollout(ravl.TrueModel(), policy, start, 4, 0.1, rng)
    assert len(ro["obs"]) == 80 and np.all(ro["pen"] == 0)  # exact dynamics: uncertainty is zero
    mask = ravl.edge_of_reach_mask(ro["obs"], ro["next_obs"], ro["term"])
    np.testing.assert_array_equal(mask, ro["t"] == 3)
    # each transition follows the true dynamics
    nxt, r = D.pendulum_model(ro["obs"], ro["act"])
    np.testing.assert_allclose(ro["next_obs"], nxt, atol=1e-6)


def test_uncertainty_is_ensemble_disagreement():
    same = np.repeat(np.random.default_rng(0).normal(size=(1, 5, 3)), 4, 0)
    assert np.all(ravl.uncertainty(same) == 0)
    means = np.random.default_rng(1).normal(size=(4, 5, 3))
    naive = [np.sqrt(sum(np.std(means[:, b, j]) ** 2 for j in range(3))) for b in range(5)]
    np.testing.assert_allclose(ravl.uncertainty(means), naive, rtol=1e-5)


def test_q_ensemble_equals_member_loop_and_target_uses_min():
    torch.manual_seed(0)
    qf = ravl.QEnsemble(5, 3, 1, 16)
    s, a = torch.randn(7, 3), torch.randn(7, 1)
    out = qf(s, a)
    x = torch.cat([s, a], -1)
    for k in range(5):
        h = x
        for i, layer in enumerate(l for l in qf.net.net if isinstance(l, ravl.EnsembleLinear)):
            h = h @ layer.w[k] + layer.b[k, 0]
            h = torch.relu(h) if i < 2 else h
        torch.testing.assert_close(out[k], h.squeeze(-1))
    actor = D.Actor(3, 1, 16)
    r, d = torch.randn(7), torch.zeros(7)
    loss, q = ravl.critic_loss(qf, qf, actor, s, a, r, s, d, 0.9, 0.0, 0.5)
    y = r + 0.9 * qf(s, actor(s)).min(0).values
    torch.testing.assert_close(loss, ((qf(s, a) - y) ** 2).mean(1).sum())


def test_learns_with_true_dynamics(tmp_path):
    s = ravl.main(ravl.Args(total_steps=1500, eval_every=750, rollout_every=250, out_dir=str(tmp_path)))
    assert s["score_best"] > s["score_first"] + 20, s
    assert s["penalty_mean_last"] == 0.0 and (tmp_path / "curve.png").exists()


@pytest.mark.parametrize("kw,msg", [({"model": "perfect"}, "--model"), ({"pessimism": "max"}, "--pessimism"),
                                    ({"dataset": "toy-multimodal"}, "pendulum dataset"),
                                    ({"n_critics": 1}, "--n-critics"), ({"real_ratio": 1.5}, "--real-ratio")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        ravl.main(ravl.Args(out_dir=str(tmp_path), **kw))
