"""worldmodels/live.py: the reverse pass uses inverse actions (checked with the true dynamics), curriculum,
cycle-loss gradients, learning, bad input."""
import numpy as np
import pytest
import torch

from worldmodels import live
from worldmodels._envs import MOVES, EnvConfig, agent_cells, collect


def true_step(ctx: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Known dynamics on frames in [-1, 1]: move the agent of the last context frame unless a wall blocks it."""
    x = ctx[:, -1].clone()
    frames01 = ((x + 1) / 2).numpy()
    cells = agent_cells(frames01, EnvConfig())
    tgt = cells + MOVES[action.numpy()]
    n = len(x)
    blocked = frames01[np.arange(n), 0, tgt[:, 0], tgt[:, 1]] > 0.5
    new = np.where(blocked[:, None], cells, tgt)
    x[:, 2] = -1
    x[torch.arange(n), 2, torch.from_numpy(new[:, 0]), torch.from_numpy(new[:, 1])] = 1
    return x


def _data(n=64, t=8, seed=0):
    fr, _, eff = collect(EnvConfig(), n, t, seed=seed)
    return torch.from_numpy(fr) * 2 - 1, torch.from_numpy(eff)


def test_reverse_actions():
    a = torch.tensor([[0, 2, 4, 3]])
    assert live.reverse_actions(a).tolist() == [[2, 4, 3, 1]]


def test_cycle_with_true_dynamics_returns_the_initial_frame():
    frames, acts = _data()
    k = 2
    ctx0 = torch.stack([frames[:, 0], frames[:, 0]], 1)
    for n in (1, 3, 8):
        fwd = live.forward_reverse(true_step, ctx0, acts[:, :n], k)[2]
        torch.testing.assert_close(fwd, frames[:, 1:n + 1])  # the oracle reproduces the forward rollout
        torch.testing.assert_close(live.reconstruct_initial(true_step, ctx0, acts[:, :n], k), frames[:, 0])


def test_cycle_with_forward_actions_would_not_return(monkeypatch):
    """Guards the test above: a reverse pass that replays the forward actions misses x_0."""
    frames, acts = _data()
    ctx0 = torch.stack([frames[:, 0], frames[:, 0]], 1)
    monkeypatch.setattr(live, "reverse_actions", lambda a: a.flip(1))
    rec = live.reconstruct_initial(true_step, ctx0, acts[:, :4], 2)
    assert not torch.equal(rec, frames[:, 0])


def test_reverse_pass_sees_the_inverse_actions_in_reverse_order():
    seen = []

    def recorder(ctx, a):
        seen.append(a.clone())
        return ctx[:, -1]

    acts = torch.tensor([[0, 3, 3, 2]])
    live.reconstruct_initial(recorder, torch.zeros(1, 2, 3, 10, 10), acts, 2)
    assert [int(s) for s in seen] == [0, 3, 3, 2] + [3, 2, 2, 1]  # forward, then inv(a_3) ... inv(a_0)


def test_curriculum():
    lens = [live.curriculum_length(s, 100, 8, 0.2, 0.5) for s in range(100)]
    assert lens[:20] == [0] * 20 and lens[20] == 1 and lens[70:] == [8] * 30
    assert all(b >= a for a, b in zip(lens, lens[1:]))


def test_cycle_loss_trains_the_model_not_the_context():
    torch.manual_seed(0)
    model = live.Denoiser(context=2, channels=8)
    rev_ctx = torch.randn(4, 2, 3, 10, 10, requires_grad=True)
    loss = live.cycle_loss(model, torch.rand(4, 3, 10, 10), rev_ctx, torch.randint(0, 5, (4,)))
    loss.backward()
    assert rev_ctx.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_live_learns_one_step(tmp_path):
    """A small trained instance puts the agent in the right cell one step ahead in at least 95% of test
    rollouts (with one-hot action planes only, --no-action-gate, it lost the agent) and beats copying."""
    s = live.main(live.Args(mode="live", steps=800, batch_size=128, train_traj=300, eval_traj=64,
                            eval_horizons=(1, 4), cycle_horizon=2, cycle_batch=8, cycle_start=0.5,
                            curriculum=0.25, out_dir=str(tmp_path), save_png=False))
    assert s["agent_err_h1"] <= 0.05, s
    assert s["err_h1"] < s["copy_err_h1"], s
    assert np.isfinite(s["cycle_loss_last"]) and s["cycle_loss_last"] > 0
    rows = [l for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if "train/cycle_len" in l]
    assert '"train/cycle_len": 2' in rows[-1]


@pytest.mark.parametrize("kw,msg", [({"mode": "xx"}, "mode"), ({"cycle_horizon": 99}, "cycle-horizon"),
                                    ({"cycle_start": 0.8, "curriculum": 0.5}, "cycle-start"),
                                    ({"cycle_batch": 0}, "cycle-batch")])
def test_bad_args(kw, msg):
    with pytest.raises(SystemExit, match=msg):
        live.check_args(live.Args(**kw))
