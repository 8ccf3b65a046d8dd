"""algos/habc.py: intervention-aware labels, the two heads' losses, one-step advantages, the gate, the merge and the
weights against hand-computed values; the simulated interventions; the degenerate cases that tie the methods
together; learning over rounds; clear errors."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from algos import _offline_data as D
from algos import habc

NONE, SUCCESS, FAILURE = habc.NONE, habc.SUCCESS, habc.FAILURE


# ---- outcome labels ----
def episodes():
    """Three episodes, flattened in (episode, t) order. P = policy step, E = expert (intervention) step.
    ep 0: P P P E E E P P, reaches the goal; ep 1: P P E P, times out; ep 2: E E P P, falls into a pit."""
    ep = [0] * 8 + [1] * 4 + [2] * 4
    expert = [0, 0, 0, 1, 1, 1, 0, 0] + [0, 0, 1, 0] + [1, 1, 0, 0]
    kind = [NONE] * 7 + [SUCCESS] + [NONE] * 4 + [NONE] * 3 + [FAILURE]
    return ep, expert, kind


def test_outcome_labels_skip_intervention_segments():
    """By hand, gamma = 0.5. Episode 0 succeeds, but only its last policy segment (t = 6, 7) reached the goal: it is
    labelled success (y = 0.5^1, 0.5^0; steps left 2, 1); the first policy segment, which ended in a takeover, is a
    failure (y = 0), and the expert's segment has no label at all. The timed-out and the failed episodes label
    their policy steps 0 and their expert steps not at all; neither has efficiency labels."""
    y, m_v, c, m_e = habc.outcome_labels(*episodes(), gamma=0.5)
    assert m_v.tolist() == [1, 1, 1, 0, 0, 0, 1, 1] + [1, 1, 0, 1] + [0, 0, 1, 1]
    assert y.tolist() == [0, 0, 0, 0, 0, 0, 0.5, 1] + [0] * 4 + [0] * 4
    assert m_e.tolist() == [0] * 6 + [1, 1] + [0] * 8
    assert c.tolist() == [0] * 6 + [2, 1] + [0] * 8


def test_episode_credit_leaks_the_outcome_across_interventions():
    """The naive control: every step of episode 0, the expert's and the policy's steps before the takeover included,
    takes the episode's success (y = 0.5^(7 - t), steps left 8 - t); the other episodes are failures throughout."""
    y, m_v, c, m_e = habc.outcome_labels(*episodes(), gamma=0.5, credit="episode")
    assert m_v.all()
    assert y.tolist() == [0.5 ** (7 - t) for t in range(8)] + [0] * 8
    assert c.tolist() == [8 - t for t in range(8)] + [0] * 8
    assert m_e.tolist() == [1] * 8 + [0] * 8


def test_outcome_labels_of_a_real_rollout_follow_the_actors():
    """On collected rollouts with interventions: no expert step is labelled, every policy step is, a policy step
    has an efficiency label exactly when its episode reached the goal with no takeover after it."""
    args = habc.Args(catch_prob=1.0, patience=3)
    grid, rng = habc.Grid(), np.random.default_rng(0)
    out = habc.rollout(grid, lambda p: rng.integers(4, size=len(p)), 64, args, rng, intervene=True)
    y, m_v, c, m_e = habc.outcome_labels(out["ep"], out["expert"], out["kind"])
    assert out["expert"].any() and (~out["expert"]).any()
    assert (m_v == ~out["expert"]).all()
    for e in range(64):
        rows = np.flatnonzero(out["ep"] == e)
        later_expert = np.cumsum(out["expert"][rows][::-1])[::-1] > 0  # an expert step at or after t
        want = (out["outcome"][e] == SUCCESS) & ~later_expert
        assert (m_e[rows] == want).all() and (y[rows] == want).all()
        assert (c[rows][want] == np.arange(want.sum(), 0, -1)).all()  # steps left count down to 1


# ---- the heads, the advantages, the gate, the weights ----
def test_critic_loss_matches_naive_loop():
    """BCE of the viability logit on the m_v rows, squared error of C / H on the m_e rows, each averaged over its own
    rows. Catches: a loss averaged over all rows, a label leaking into the other head, C compared in steps."""
    torch.manual_seed(0)
    critic, s = D.mlp(5, 2, 8), torch.randn(6, 5)
    y = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.25])
    m_v = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    c = torch.tensor([0.0, 3.0, 7.0, 1.0, 0.0, 0.0])
    m_e = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    loss, l_v, l_e = habc.critic_loss(critic, s, y, m_v, c, m_e, horizon=10)
    out = critic(s).detach()
    bce = [-(y[i] * math.log(torch.sigmoid(out[i, 0])) + (1 - y[i]) * math.log(1 - torch.sigmoid(out[i, 0])))
           for i in range(6) if m_v[i]]
    se = [(out[i, 1].item() - c[i].item() / 10) ** 2 for i in range(6) if m_e[i]]
    assert l_v.item() == pytest.approx(sum(bce) / 4, rel=1e-5)
    assert l_e.item() == pytest.approx(sum(se) / 3, rel=1e-5)
    assert loss.item() == pytest.approx(l_v.item() + l_e.item(), rel=1e-6)


def test_one_step_advantages_by_hand():
    """gamma = 0.9, H = 40. Row 0 (ordinary s'): A_v = 0.9 * 0.5 - 0.4 = 0.05, A_e = 10 - 1 - 8 = 1. Row 1 (s' the
    goal): A_v = 1 - 0.8 = 0.2 (no discount on the step that succeeds), A_e = 1.5 - 1 - 0 = 0.5. Row 2 (s' a pit):
    A_v = 0 - 0.6, A_e = 3 - 1 - 40 = -38. The critic's values at terminal s' are ignored."""
    v, v2 = torch.tensor([0.4, 0.8, 0.6]), torch.tensor([0.5, 0.3, 0.9])
    c, c2 = torch.tensor([10.0, 1.5, 3.0]), torch.tensor([8.0, 99.0, 99.0])
    a_v, a_e = habc.one_step_advantages(v, v2, c, c2, [NONE, SUCCESS, FAILURE], gamma=0.9, horizon=40)
    torch.testing.assert_close(a_v, torch.tensor([0.05, 0.2, -0.6]))
    torch.testing.assert_close(a_e, torch.tensor([1.0, 0.5, -38.0]))


def test_gate_by_hand():
    """v_lo = 0.5, v_hi = 0.9: 0 at or below 0.5, a linear ramp between, 1 at or above 0.9."""
    v = torch.tensor([0.0, 0.5, 0.6, 0.7, 0.9, 1.0])
    torch.testing.assert_close(habc.gate(v, 0.5, 0.9), torch.tensor([0.0, 0.0, 0.25, 0.5, 1.0, 1.0]))


def test_merged_advantage_and_weights_by_hand():
    """A = (1 - g) A_v / sigma_v + g A_e / sigma_e with sigma_v = 0.1, sigma_e = 2:
    g = 0: 0.05 / 0.1 = 0.5; g = 0.25: 0.75 * 2 + 0.25 * 0.25 = 1.5625; g = 1: -38 / 2 = -19.
    Weights exp(A) clipped at 4: e^0.5, 4 (e^1.5625 = 4.77 is clipped), e^-19."""
    a_v, a_e = torch.tensor([0.05, 0.2, -0.6]), torch.tensor([1.0, 0.5, -38.0])
    adv = habc.merged_advantage(a_v, a_e, torch.tensor([0.0, 0.25, 1.0]), 0.1, 2.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, 1.5625, -19.0]))
    w = habc.awbc_weights(adv, beta=1.0, max_weight=4.0)
    torch.testing.assert_close(w, torch.tensor([math.exp(0.5), 4.0, math.exp(-19.0)]))
    assert habc.awbc_weights(adv, beta=0.0, max_weight=4.0).tolist() == [1.0, 1.0, 1.0]  # beta = 0: plain BC


def test_actor_loss_matches_naive_loop():
    torch.manual_seed(0)
    actor, s = D.mlp(5, 4, 8), torch.randn(7, 5)
    a, w = torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.rand(7) * 3
    logp = torch.log_softmax(actor(s), -1).detach()
    naive = sum(-w[i].item() * logp[i, a[i]].item() for i in range(7)) / 7
    assert habc.actor_loss(actor, s, a, w).item() == pytest.approx(naive, rel=1e-5)


class TableCritic(torch.nn.Module):
    """A critic whose outputs (viability logit, C / H) are looked up by the one-hot cell of the features."""

    def __init__(self, grid, v, c_steps, horizon):
        super().__init__()
        self.n = grid.h * grid.w
        self.table = torch.stack([torch.logit(torch.as_tensor(v, dtype=torch.float32)),
                                  torch.as_tensor(c_steps, dtype=torch.float32) / horizon], 1)

    def forward(self, x):
        return self.table[x[:, :self.n].argmax(1)]


def weights_data(seed=0):
    grid, rng, args = habc.Grid(), np.random.default_rng(seed), habc.Args()
    out = habc.rollout(grid, lambda p: rng.integers(4, size=len(p)), 16, args, rng, intervene=True)
    data = habc.to_tensors(grid, [out], args)
    n = grid.h * grid.w
    v = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.05, 0.95, n))
    c = torch.as_tensor(np.random.default_rng(seed + 2).uniform(1, 30, n))
    return grid, args, data, v, c


def test_transition_weights_against_the_pipeline_by_hand():
    """HABC's weights on collected data with a table critic equal the equations applied step by step: the one-step
    advantages, their std over the data, the gate on V(s), the merge and the clipped exponential."""
    grid, args, data, v, c = weights_data()
    critic = TableCritic(grid, v, c, args.horizon)
    w, diag = habc.transition_weights(critic, data, args)
    cell = lambda x: x[:, :grid.h * grid.w].argmax(1)  # noqa: E731
    vs, vs2, cs, cs2 = v[cell(data["x"])].float(), v[cell(data["x2"])].float(), c[cell(data["x"])].float(), \
        c[cell(data["x2"])].float()
    kind = data["kind"]
    a_v = torch.where(kind == SUCCESS, 1.0, torch.where(kind == FAILURE, 0.0, args.gamma * vs2)) - vs
    a_e = cs - 1 - torch.where(kind == SUCCESS, 0.0, torch.where(kind == FAILURE, float(args.horizon), cs2))
    g = ((vs - args.v_lo) / (args.v_hi - args.v_lo)).clamp(0, 1)
    adv = (1 - g) * a_v / (a_v.std() + 1e-6) + g * a_e / (a_e.std() + 1e-6)
    torch.testing.assert_close(w, torch.exp(args.beta * adv).clamp(max=args.max_weight), rtol=1e-4, atol=1e-6)
    assert 0 < diag["train/gate_mean"] < 1


def test_habc_with_a_closed_gate_equals_awbc():
    """Where every state's viability is at or below v_lo the gate is 0 and HABC's weights are AWBC's (the viability
    advantage alone); AWBC ignores the gate whatever the viability; BC's weights are all 1."""
    grid, args, data, v, c = weights_data()
    low = TableCritic(grid, v * 0.5, c, args.horizon)  # every V <= 0.475 < v_lo = 0.5
    w_habc, _ = habc.transition_weights(low, data, args)
    w_awbc, _ = habc.transition_weights(low, data, habc.Args(method="awbc"))
    torch.testing.assert_close(w_habc, w_awbc)
    high = TableCritic(grid, v, c, args.horizon)
    w_awbc_high, diag = habc.transition_weights(high, data, habc.Args(method="awbc"))
    w_habc_high, _ = habc.transition_weights(high, data, args)
    assert diag["train/gate_mean"] == 0 and not torch.allclose(w_awbc_high, w_habc_high)
    w_bc, diag = habc.transition_weights(high, data, habc.Args(method="bc"))
    assert (w_bc == 1).all() and diag == {}


# ---- the world and the simulated interventions ----
def test_expert_follows_a_shortest_safe_path():
    grid = habc.Grid()
    free = np.argwhere((grid.dist > 0))
    nxt = grid.move(free, grid.expert(free))
    assert (grid.dist[nxt[:, 0], nxt[:, 1]] == grid.dist[free[:, 0], free[:, 1]] - 1).all()
    out = habc.demonstrations(grid, 20, habc.Args(demo_eps=0.0), np.random.default_rng(0))
    assert (out["outcome"] == SUCCESS).all() and (out["steps"] == out["start_dist"]).all()
    assert sorted(grid.dist[grid.starts[:, 0], grid.starts[:, 1]].tolist()) == [20, 21, 21, 22]


def test_wandering_policy_is_taken_over_on_schedule():
    """A policy that always moves left bumps into the grid's left edge (no progress): after `patience` = 3 of its
    steps the expert drives `intervene_steps` = 2 steps, then the policy again: P P P E E P P P E E, a timeout.
    (A third takeover would follow at once: from the cell the expert leaves it in, left is a pit.)"""
    args = habc.Args(patience=3, intervene_steps=2, horizon=10, catch_prob=1.0)
    grid, rng = habc.Grid(), np.random.default_rng(0)
    out = habc.rollout(grid, lambda p: np.full(len(p), 2), 5, args, rng, intervene=True)
    for e in range(5):
        rows = out["ep"] == e
        assert out["expert"][rows].astype(int).tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
        assert out["t"][rows].tolist() == list(range(10))
    assert (out["outcome"] == NONE).all() and (out["takeovers"] == 2).all()


def test_pit_steps_are_caught_or_fail():
    """A policy that always moves up walks from the start column into the pit above it: with catch_prob = 1 the
    expert takes over every time the next move would enter the pit and no episode falls; with catch_prob = 0 (or
    no interventions) every episode does. A caught step records the expert's action, not the policy's."""
    grid = habc.Grid()
    up = lambda p: np.zeros(len(p), int)  # noqa: E731
    caught = habc.rollout(grid, up, 20, habc.Args(catch_prob=1.0, patience=100), np.random.default_rng(0), True)
    assert (caught["outcome"] != FAILURE).all() and (caught["takeovers"] >= 1).all()
    into_pit = grid.kind(grid.move(caught["s"], np.zeros(len(caught["s"]), int))) == FAILURE
    first_expert = caught["expert"] & ~np.r_[False, caught["expert"][:-1]]
    assert into_pit[first_expert].all() and (caught["a"][first_expert] != 0).all()
    fell = habc.rollout(grid, up, 20, habc.Args(catch_prob=0.0, patience=100), np.random.default_rng(0), True)
    assert (fell["outcome"] == FAILURE).all() and not fell["expert"].any()


def test_features_one_hot_and_coordinates():
    grid = habc.Grid()
    x = grid.features(np.array([[0, 0], [11, 11], [3, 5]]))
    assert x.shape == (3, 146) and (x[:, :144].sum(1) == 1).all()
    assert x[2, 3 * 12 + 5] == 1
    torch.testing.assert_close(x[:, -2:], torch.tensor([[0.0, 0.0], [1.0, 1.0], [3 / 11, 5 / 11]]))


# ---- learning and errors ----
def test_learns_success_and_steps_over_rounds(tmp_path):
    """A short run (4 rounds): the SFT policy's success rises by at least 30 points and its steps to the goal fall."""
    s = habc.main(habc.Args(rounds=4, eval_episodes=100, out_dir=str(tmp_path)))
    assert s["success_last"] >= s["success_first"] + 0.3, s
    assert s["steps_last"] < s["steps_first"] - 2, s
    assert (tmp_path / "curve.png").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("kw,msg", [({"method": "ppo"}, "--method"), ({"credit": "all"}, "--credit"),
                                    ({"rounds": 0}, "--rounds"), ({"catch_prob": 1.5}, "--catch-prob"),
                                    ({"gamma": 0.0}, "--gamma"), ({"v_lo": 0.9, "v_hi": 0.5}, "--v-lo"),
                                    ({"beta": -1.0}, "--beta"), ({"horizon": -3}, "--horizon")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        habc.main(habc.Args(out_dir=str(tmp_path), **kw))
