"""worldmodels/_envs.py: determinism, inverse actions, frame layout, policies of graded quality, bad input, and the
helpers the world-model scripts share (training windows, rollout evaluation)."""
import numpy as np
import pytest
import torch

from worldmodels._envs import (INVERSE, MOVES, N_ACTIONS, NOOP, EnvConfig, GridWorld, agent_cells, collect,
                               greedy_actions, horizon_errors, inverse, random_windows, report_rollouts, windows)


def test_deterministic_per_seed():
    a = collect(EnvConfig(), 64, 12, seed=3)
    b = collect(EnvConfig(), 64, 12, seed=3)
    c = collect(EnvConfig(), 64, 12, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])


def test_inverse_table():
    for act in range(N_ACTIONS):
        assert (MOVES[act] + MOVES[INVERSE[act]] == 0).all()
        assert INVERSE[INVERSE[act]] == act
    np.testing.assert_array_equal(inverse(np.array([0, 1, 2, 3, 4])), [1, 0, 3, 2, 4])


@pytest.mark.parametrize("view", [None, 7])
def test_action_then_inverse_restores_state(view):
    cfg = EnvConfig(map_size=12, view=view)
    env = GridWorld(cfg, 256, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(5):
        before_pos, before_frames = env.pos.copy(), env.render()
        acts = rng.integers(0, N_ACTIONS, size=256)
        eff = env.step(acts)
        moved = eff != NOOP
        assert moved.any() and (~moved & (acts != NOOP)).any()  # some moves are blocked by walls
        env.step(inverse(eff))  # the effective action's inverse always undoes it
        np.testing.assert_array_equal(env.pos, before_pos)
        np.testing.assert_array_equal(env.render(), before_frames)
        env.step(rng.integers(0, N_ACTIONS, size=256))


def test_blocked_move_is_a_noop():
    env = GridWorld(EnvConfig(), 1, seed=0)
    env.pos[:] = [[1, 1]]  # top-left interior cell: up is the border wall
    assert env.step(np.array([0]))[0] == NOOP
    np.testing.assert_array_equal(env.pos, [[1, 1]])


@pytest.mark.parametrize("cfg,size", [(EnvConfig(), 10), (EnvConfig(map_size=8, cell_px=2), 16),
                                      (EnvConfig(map_size=16, view=9, cell_px=3), 27)])
def test_frame_shape_and_range(cfg, size):
    frames, acts, eff = collect(cfg, 8, 5, seed=1)
    assert frames.shape == (8, 6, 3, size, size) and frames.dtype == np.float32
    assert acts.shape == eff.shape == (8, 5)
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert set(np.unique(frames[:, :, 1])) <= {0.0, 0.5, 1.0}  # objects: goal 1, others 0.5
    assert (frames[:, :, 2].reshape(8, 6, -1).sum(-1) == cfg.cell_px ** 2).all()  # exactly one agent
    if cfg.view is None:
        assert (frames[:, :, 0, 0, :] == 1).all()  # border walls
    else:
        c = size // 2
        assert (frames[:, :, 2, c, c] == 1).all()  # egocentric: the agent sits in the centre


def test_agent_cells_decodes_positions():
    cfg = EnvConfig(map_size=9, cell_px=2)
    env = GridWorld(cfg, 32, seed=2)
    np.testing.assert_array_equal(agent_cells(env.render(), cfg), env.pos)


def test_agent_cell_error_on_hand_made_frames():
    """The error tables' agent-cell metric: right only for exactly one agent drawn in the true cell."""
    cfg = EnvConfig(map_size=6)
    true = np.zeros((1, 2, 3, 6, 6), np.float32)  # one trajectory, h = 0..1
    true[0, 0, 2, 2, 2] = true[0, 1, 2, 2, 3] = 1.0  # the agent steps right
    def err(frame):
        pred = true.copy()
        pred[0, 1] = frame
        return horizon_errors(pred, true, cfg)[1][1]
    blank = np.zeros((3, 6, 6), np.float32)
    same = blank.copy(); same[2, 2, 3] = 1.0
    moved = blank.copy(); moved[2, 2, 2] = 1.0  # drawn where it was (a copy of the last frame)
    missing = blank.copy(); missing[2, 2, 3] = 0.4  # faint: below 0.5, no agent drawn
    two = same.copy(); two[2, 4, 4] = 0.9  # a second agent
    soft = blank.copy(); soft[2, 2, 3] = 0.7; soft[2, 2, 2] = 0.3  # smeared, but one cell clearly drawn
    assert err(same) == 0.0 and err(soft) == 0.0
    assert err(moved) == err(missing) == err(two) == 1.0
    np.testing.assert_array_equal(agent_cells(np.stack([same, missing, two]), cfg, strict=True),
                                  [[2, 3], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(agent_cells(np.stack([same, missing, two]), cfg), [[2, 3], [2, 3], [2, 3]])


def test_egocentric_window_hides_part_of_a_large_map():
    cfg = EnvConfig(map_size=20, view=5)
    env = GridWorld(cfg, 4, seed=0)
    assert env.render().shape[-1] == 5 < cfg.map_size


def test_policies_are_graded():
    rates = []
    for eps in (0.0, 0.5, 1.0):
        env = GridWorld(EnvConfig(), 400, seed=5)
        rng = np.random.default_rng(0)
        done = np.zeros(400, bool)
        for _ in range(15):
            env.step(greedy_actions(env.distance(), env.pos, eps, rng))
            done |= env.at_goal()
        rates.append(done.mean())
    assert rates[0] > 0.97 and rates[0] > rates[1] + 0.1 > rates[2] + 0.2


def test_fast_enough_to_draw_many_frames():
    frames, _, _ = collect(EnvConfig(), 500, 40, seed=0)  # 20,500 frames; timing is not asserted
    assert frames.shape[:2] == (500, 41)


@pytest.mark.parametrize("kwargs,msg", [({"map_size": 3}, "map_size"), ({"view": 4}, "view"),
                                        ({"wall_density": 0.9}, "wall_density"), ({"n_objects": 0}, "n_objects"),
                                        ({"cell_px": 0}, "cell_px")])
def test_bad_config(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        EnvConfig(**kwargs)


def test_bad_actions():
    env = GridWorld(EnvConfig(), 4, seed=0)
    with pytest.raises(ValueError, match="actions"):
        env.step(np.array([0, 1, 7, 2]))
    with pytest.raises(ValueError, match="actions"):
        env.step(np.array([0, 1]))


def test_random_windows_are_windows_at_in_range_starts():
    frames, acts = torch.arange(5 * 9.0).reshape(5, 9, 1, 1, 1), torch.arange(5 * 8).reshape(5, 8)
    win, wacts = random_windows(frames, acts, 200, k=2, h=3, gen=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # the same draws, made by hand
    rows, starts = torch.randint(0, 5, (200,), generator=g), torch.randint(0, 8 - 3 + 1, (200,), generator=g)
    ref_win, ref_acts = windows(frames[rows], acts[rows], starts, 2, 3)
    assert torch.equal(win, ref_win) and torch.equal(wacts, ref_acts)
    assert set(starts.tolist()) == set(range(6))  # every start that leaves room for h actions, and no other


class _Log:
    def __init__(self):
        self.rows = []

    def log(self, metrics, step):
        self.rows.append((step, metrics))


def test_report_rollouts_scores_perfect_and_copy_rollouts():
    cfg = EnvConfig()
    true = collect(cfg, 16, 4, seed=0)[0]
    log = _Log()
    s = report_rollouts(log, true.copy(), true, cfg, (1, 4), train_horizon=2)
    assert s["err_h1"] == s["err_h4"] == s["agent_err_h1"] == s["agent_err_h4"] == 0.0
    assert s["copy_err_h4"] > 0 and len(s["err_curve"]) == 4 and s["train_horizon"] == 2
    assert [step for step, _ in log.rows] == [1, 2, 3, 4]
    copy = report_rollouts(_Log(), np.repeat(true[:, :1], 5, 1), true, cfg, (1, 4), train_horizon=2)
    assert copy["err_h4"] == copy["copy_err_h4"] > 0 and copy["agent_err_h4"] > 0


@pytest.mark.parametrize("flag", ["threads", "channels", "steps", "batch_size", "train_traj", "traj_len", "log_every",
                                  "lr"])
def test_check_run_args_names_each_bad_flag(flag):
    """start_run refuses a zero size or learning rate, naming the flag (before: a zero-width conv or a modulo by a
    zero log interval deep inside a run)."""
    from worldmodels._envs import RunArgs, check_run_args

    check_run_args(RunArgs())
    with pytest.raises(SystemExit, match=f"--{flag.replace('_', '-')} must be"):
        check_run_args(RunArgs(**{flag: 0}))
