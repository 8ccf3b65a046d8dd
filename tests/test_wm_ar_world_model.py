"""worldmodels/ar_world_model.py: shapes, eq. (1) batched = per-step loop, eq. (2), learning, bad input."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worldmodels import ar_world_model as ar
from worldmodels._envs import windows

ROOT = Path(__file__).resolve().parent.parent


def _batch(b=4, k=2, h=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    win = (torch.rand(b, k + h, 3, 10, 10, generator=g) > 0.8).float()
    acts = torch.randint(0, 5, (b, h), generator=g)
    return win, acts


def test_shapes():
    model = ar.Predictor(context=2, channels=8)
    win, acts = _batch()
    assert model(win[:, :2], acts[:, 0]).shape == (4, 3, 10, 10)
    frames = torch.rand(5, 13, 3, 10, 10)
    w, a = windows(frames, torch.randint(0, 5, (5, 12)), torch.tensor([0, 1, 2, 3, 4]), k=2, h=3)
    assert w.shape == (5, 5, 3, 10, 10) and a.shape == (5, 3)
    assert torch.equal(w[0, 0], frames[0, 0]) and torch.equal(w[0, 1], frames[0, 0])  # padded start


def test_tf_loss_matches_per_step_loop():
    torch.manual_seed(0)
    model = ar.Predictor(context=2, channels=8)
    win, acts = _batch()
    naive = torch.stack([F.binary_cross_entropy_with_logits(model(win[:, j:j + 2], acts[:, j]), win[:, j + 2])
                         for j in range(3)]).mean()
    torch.testing.assert_close(ar.tf_loss(model, win, acts, 2), naive)


def test_chained_loss_feeds_back_own_predictions():
    torch.manual_seed(0)
    model = ar.Predictor(context=1, channels=8)
    win, acts = _batch(k=1, h=2)
    # one step: chained = teacher forcing
    torch.testing.assert_close(ar.chained_loss(model, win[:, :2], acts[:, :1], 1),
                               ar.tf_loss(model, win[:, :2], acts[:, :1], 1))
    # two steps: the second step sees sigmoid(prediction), not the true frame
    p1 = torch.sigmoid(model(win[:, :1], acts[:, 0]))
    l2 = F.binary_cross_entropy_with_logits(model(p1[:, None], acts[:, 1]), win[:, 2])
    l1 = F.binary_cross_entropy_with_logits(model(win[:, :1], acts[:, 0]), win[:, 1])
    torch.testing.assert_close(ar.chained_loss(model, win, acts, 1), (l1 + l2) / 2)


# the chained variant is an extended check (pytest.ini): the teacher-forced one shows the script learning in the suite
@pytest.mark.parametrize("chained", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.extended])])
def test_one_step_moves_the_agent(tmp_path, chained):
    """A small trained instance (teacher forcing and chained training) puts the agent in the right cell one step
    ahead in at least 95% of test rollouts, and beats copying the last frame in pixel MSE. With the action as
    one-hot planes only (--no-action-gate, the earlier default) the chained model copied the frame instead."""
    s = ar.main(ar.Args(chained=chained, steps=800, train_traj=200, eval_traj=64, eval_horizons=(1, 4),
                        train_horizon=4, out_dir=str(tmp_path), save_png=False))
    assert s["agent_err_h1"] <= 0.05, s
    assert s["err_h1"] < s["copy_err_h1"], s
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "summary.json").exists()


def test_action_gate_lets_one_convolution_move_the_agent():
    """gated_planes: a conv whose only weight reads the agent channel of action a's plane, shifted by a's move,
    draws the agent in its next cell; the one-hot planes alone carry no agent position."""
    from worldmodels._envs import MOVES, N_ACTIONS, gated_planes
    frame = torch.zeros(N_ACTIONS, 3, 10, 10)
    frame[:, 2, 5, 5] = 1.0
    acts = torch.arange(N_ACTIONS)
    planes = gated_planes(frame, acts)  # (5, 15, 10, 10)
    w = torch.zeros(1, 3 * N_ACTIONS, 3, 3)
    for a in range(N_ACTIONS):
        dr, dc = MOVES[a]
        w[0, a * 3 + 2, 1 - dr, 1 - dc] = 1.0  # output (r, c) reads input (r - dr, c - dc)
    out = F.conv2d(planes, w, padding=1)[:, 0]
    for a in range(N_ACTIONS):
        dr, dc = MOVES[a]
        assert out[a, 5 + dr, 5 + dc] == 1.0 and out[a].sum() == 1.0


def test_png_is_written(tmp_path):
    ar.main(ar.Args(steps=2, train_traj=20, eval_traj=4, eval_horizons=(1, 2), out_dir=str(tmp_path)))
    assert (tmp_path / "strip.png").stat().st_size > 1000


@pytest.mark.parametrize("kw,msg", [({"context": 0}, "context"), ({"train_horizon": 99}, "train-horizon"),
                                    ({"eval_horizons": (0, 4)}, "eval-horizons"), ({"chain_warmup": 1.0}, "chain-warmup")])
def test_bad_args(kw, msg):
    with pytest.raises(SystemExit, match=msg):
        ar.check_args(ar.Args(**kw))


def test_a_bad_flag_on_the_command_line_ends_with_its_message():
    """The world-model scripts stop on a bad flag with its message, no traceback."""
    out = subprocess.run([sys.executable, "worldmodels/ar_world_model.py", "--context", "0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--context must be >= 1" in out.stderr and "Traceback" not in out.stderr
